"""`gputrace export`: the metrics scraped over HTTP from a real server and parsed with
prometheus_client's own text parser; bounded series; and, with real eBPF, simcuda workloads."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gputrace import simcuda
from gputrace.exporter.metrics import FleetMetrics
from gputrace.exporter.server import parse_listen, serve
from gputrace.hostview.model import HostSnapshot
from gputrace.hostview.pods import Identity
from topdata import PROCS, T0, frame

CLI = [sys.executable, "-m", "gputrace"]


class Frames:
    """A source of frames a test hands over one by one (`push`), then ends (`end`)."""

    calibration = None

    def __init__(self) -> None:
        self._q: list[HostSnapshot | None] = []
        self._cv = threading.Condition()
        self.taken = 0

    def push(self, f: HostSnapshot | None) -> None:
        with self._cv:
            self._q.append(f)
            self._cv.notify()

    def end(self) -> None:
        self.push(None)

    def frames(self):
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._q)
                f = self._q.pop(0)
            if f is None:
                return
            yield f
            with self._cv:
                self.taken += 1
                self._cv.notify_all()

    def wait_taken(self, n: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.taken >= n, timeout=30)

    def close(self) -> None:
        pass


@pytest.fixture
def exporter():
    """(source, metrics, scrape): a real HTTP server on a free port, fed by the test's frames."""
    src, metrics, ready = Frames(), FleetMetrics(per_function=2), threading.Event()
    port = []
    t = threading.Thread(target=serve, args=(src, metrics, "127.0.0.1", 0),
                         kwargs={"on_ready": lambda p: (port.append(p), ready.set())}, daemon=True)
    t.start()
    assert ready.wait(30)

    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port[0]}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    yield src, metrics, scrape
    src.end()
    t.join(30)


def samples(fams: dict, name: str, **labels) -> list:
    """The samples called `name` (a counter's family drops its `_total`) with these labels."""
    fam = fams.get(name.removesuffix("_total"))
    return [s for s in (fam.samples if fam else ()) if s.name == name
            and all(s.labels.get(k) == v for k, v in labels.items())]


def test_scraped_metrics_follow_the_frames(exporter):
    src, _, scrape = exporter
    src.push(frame(0))
    src.push(frame(1))
    src.wait_taken(2)
    fams = scrape()
    # Counters: the metric family drops `_total`, the sample keeps it.
    assert fams["gputrace_process_driver_calls"].type == "counter"
    pid, comm, launch, getters, sync_ns, _ = PROCS[0]
    got = {s.labels["class"]: s.value for s in fams["gputrace_process_driver_calls"].samples
           if s.name == "gputrace_process_driver_calls_total" and s.labels["pid"] == str(pid)}
    f1 = frame(1).processes[0].snapshot
    want = {c.cls.value: c.rate_hz * 1.0 for c in f1.classes}  # one second between the two frames
    assert got == pytest.approx(want)
    assert samples(fams, "gputrace_process_driver_calls_total", pid=str(pid))[0].labels["comm"] == comm
    (w,) = samples(fams, "gputrace_process_wait_seconds_total", pid=str(pid))
    assert w.value == pytest.approx(f1.wait_s_per_s)
    (lo,) = samples(fams, "gputrace_process_predicted_slowdown_ratio", pid=str(pid), preset="shim", bound="lower")
    (hi,) = samples(fams, "gputrace_process_predicted_slowdown_ratio", pid=str(pid), preset="shim", bound="upper")
    a = frame(1).processes[0].audit("shim")
    assert (lo.value, hi.value) == pytest.approx((a.slowdown_lower, a.slowdown_upper)) and 0 <= lo.value <= hi.value
    assert samples(fams, "gputrace_budget_ratio")[0].value == 0.01
    states = {s.labels["state"]: s.value for s in fams["gputrace_processes"].samples}
    assert states == {"traced": 4, "pending": 0, "untraceable": 0}
    # --per-function 2: each process's two busiest functions, no more.
    fn = {(s.labels["pid"], s.labels["function"]) for s in fams["gputrace_process_function_calls"].samples}
    assert {f for p, f in fn if p == str(pid)} == {"cuCtxGetDevice_v2", "cuLaunchKernel"}
    assert "process_cpu_seconds_total" in {s.name for f in fams.values() for s in f.samples}  # the exporter's own
    # GPU memory per process from NVML's list: 4242 holds 30 GiB on GPU0; 9999 (not traced) has no series.
    (gm,) = samples(fams, "gputrace_process_gpu_memory_bytes", pid=str(pid), gpu="0")
    assert gm.value == 30 << 30
    assert {s.labels["pid"] for s in samples(fams, "gputrace_process_gpu_memory_bytes")} == {"4242", "1111"}


def test_not_measured_has_no_series_and_exited_processes_lose_theirs(exporter):
    src, _, scrape = exporter
    f0 = frame(0)
    nm = dataclasses.replace(f0.processes[1].snapshot, wait_s_per_s=None)  # wait not measured in this process
    nm = dataclasses.replace(nm, interval_s=0.0)  # nor the tracer's share (no span): no tracer series either
    rows = (f0.processes[0], dataclasses.replace(f0.processes[1], snapshot=nm))
    src.push(dataclasses.replace(f0, processes=rows, pending=(9999,), notes=("pid 9999: no window yet",
                                                                           "pid 8888: permission denied")))
    src.wait_taken(1)
    fams = scrape()
    assert not samples(fams, "gputrace_process_wait_seconds_total", pid=str(PROCS[1][0]))  # never a 0
    assert not samples(fams, "gputrace_process_tracer_seconds_total", pid=str(PROCS[1][0]))
    assert samples(fams, "gputrace_process_tracer_seconds_total", pid=str(PROCS[0][0]))
    assert samples(fams, "gputrace_process_wait_seconds_total", pid=str(PROCS[0][0]))
    assert not samples(fams, "gputrace_process_driver_calls_total", pid="9999")  # pending: no figures
    states = {s.labels["state"]: s.value for s in fams["gputrace_processes"].samples}
    assert states == {"traced": 2, "pending": 1, "untraceable": 1}
    src.push(dataclasses.replace(f0, t=f0.t + 1, processes=rows[:1]))
    src.wait_taken(2)
    fams = scrape()
    assert {s.labels["pid"] for s in fams["gputrace_process_driver_calls"].samples} == {str(PROCS[0][0])}


def test_series_stay_bounded_with_100_short_lived_processes():
    m = FleetMetrics(per_function=3)
    counts = []
    for k in range(100):
        procs = [(10_000 + k, f"job{k}", 5000.0, 100.0, 1000, False), (1, "long_lived", 100.0, 10.0, 0, False)]
        f = dataclasses.replace(frame(0, procs), t=T0 + k)
        m.update(f)
        counts.append(sum(len(fam.samples) for fam in m.collect()))
    assert max(counts) == counts[-1] == counts[1]  # one short-lived job at a time: the count never grows
    labels = {s.labels.get("pid") for fam in m.collect() for s in fam.samples}
    assert labels - {None} == {"1", "10099"}


def test_a_reused_pid_starts_from_zero():
    m = FleetMetrics()
    m.update(frame(0))
    m.update(dataclasses.replace(frame(1), t=T0 + 1))
    reused = tuple(dataclasses.replace(r, comm="other") if r.pid == PROCS[0][0] else r for r in frame(2).processes)
    m.update(dataclasses.replace(frame(2), t=T0 + 2, processes=reused))
    (fam,) = [f for f in m.collect() if f.name == "gputrace_process_driver_calls"]
    assert all(s.value == 0 for s in fam.samples if s.labels["pid"] == str(PROCS[0][0]))


def test_container_and_pod_labels_come_from_the_rows():
    m = FleetMetrics()
    ident = Identity("containerd", "a" * 64, "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "trainer-7d9f8b6c5d-x2k4q", "ml",
                     "trainer")
    f = frame(0)
    m.update(dataclasses.replace(f, processes=(dataclasses.replace(f.processes[0], identity=ident),)))
    (fam,) = [f for f in m.collect() if f.name == "gputrace_process_tracer_seconds"]
    (s,) = fam.samples
    assert (s.labels["pod"], s.labels["namespace"], s.labels["workload"], s.labels["runtime"]) == \
        ("trainer-7d9f8b6c5d-x2k4q", "ml", "trainer", "containerd")


@pytest.mark.parametrize("text, want", [(":9400", ("0.0.0.0", 9400)), ("127.0.0.1:0", ("127.0.0.1", 0)),
                                        ("[::1]:9400", ("::1", 9400))])
def test_parse_listen(text, want):
    assert parse_listen(text) == want


def test_export_usage_errors():
    r = subprocess.run(CLI + ["export", "--listen", "9400"], capture_output=True, text=True)
    assert r.returncode == 2 and "not ADDR:PORT" in r.stderr and "hint:" in r.stderr


@pytest.mark.bpf
def test_export_serves_simcuda_workloads_traced_with_real_ebpf(tmp_path):
    """`gputrace export` as a user runs it, two simcuda workloads on the host, scraped until both are
    measured: their calls by class, the node's probe cost, a busy port refused with a hint."""
    if os.geteuid() != 0:
        pytest.skip("needs root for eBPF")
    jobs = [subprocess.Popen(simcuda.workload("launch_bound") + ["--seconds", "300", "--scale", "0.2"],
                             env=simcuda.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    exp = None
    try:
        exp = subprocess.Popen(CLI + ["export", "--listen", "127.0.0.1:0", "-d", "120"], stderr=subprocess.PIPE,
                               text=True)
        port = None
        for line in exp.stderr:
            if "serving http://" in line:
                port = int(line.split("serving http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
                break
        assert port, "the exporter never said where it serves"
        deadline = time.monotonic() + 90
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            # Both measured, their submission calls too: a class is counted from its first known rate
            # on, and the seconds its rate was not known go to a counter of their own (docs/exporter.md):
            # one or the other grows for each. (Two busy launch loops on this 2-core host, a probe hit
            # ~9 us, can stay not known for minutes: the exporter says so rather than count a guess.)
            pids = {s.labels["pid"] for s in samples(fams, "gputrace_process_driver_calls_total", **{"class": "submission"})
                    if s.value > 0}
            unknown = {s.labels["pid"] for s in samples(fams, "gputrace_process_driver_calls_unknown_seconds_total",
                                                         **{"class": "submission"}) if s.value > 0}
            if {str(j.pid) for j in jobs} <= pids | unknown or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        states = {s.labels["state"]: s.value for s in fams["gputrace_processes"].samples}
        assert {str(j.pid) for j in jobs} <= pids | unknown, (states, [j.poll() for j in jobs])
        for j in jobs:
            sub = samples(fams, "gputrace_process_driver_calls_total", pid=str(j.pid), **{"class": "submission"})
            gap = samples(fams, "gputrace_process_driver_calls_unknown_seconds_total", pid=str(j.pid),
                          **{"class": "submission"})
            assert (sub and sub[0].value > 0) or (gap and gap[0].value > 0)
        kinds = {(s.labels["kind"], s.labels["call"]) for s in fams["gputrace_probe_cost_seconds"].samples}
        assert kinds == {("emulated", "counted"), ("emulated", "timed"), ("stepped", "counted"), ("stepped", "timed")}
        assert all(0 < s.value < 1e-3 for s in fams["gputrace_probe_cost_seconds"].samples)
        busy = subprocess.run(CLI + ["export", "--listen", f"127.0.0.1:{port}", "-d", "1"], capture_output=True,
                              text=True, timeout=120)
        assert busy.returncode != 0 and "cannot listen" in busy.stderr and "hint:" in busy.stderr
    finally:
        if exp is not None:
            # Its exit can take minutes here: the kernel releases each of the watch link's ~680 uprobes
            # with a grace period of its own (seen past 100 s on this 2-core VM after 8 s of exporting).
            exp.terminate()
            exp.wait(300)
        for j in jobs:
            j.kill()
            j.wait()
