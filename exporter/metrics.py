"""The host view's frames as Prometheus metrics, following Prometheus' naming rules: one prefix
(`gputrace_`), base units (seconds, bytes), `_total` on counters, ratios from 0 to 1.

Per process (labels pid, comm and its container and pod identity, hostview/pods.py):
    gputrace_process_driver_calls_total{class}       counter  estimated calls, by function class
    gputrace_process_driver_cpu_seconds_total        counter  time in driver calls that do not wait
    gputrace_process_wait_seconds_total              counter  time blocked in calls that wait for the GPU
    gputrace_process_tracer_seconds_total            counter  the job time the tracer's probes cost it
    gputrace_process_predicted_slowdown_ratio{preset, bound="lower"|"upper"}   gauge  the audit's bounds
    gputrace_process_function_calls_total{function, class}  counter  only with per_function=N: each
                                                     process's N busiest functions (at most 2N series each)
    gputrace_process_gpu_memory_bytes{gpu}           gauge    the memory it holds on each GPU (NVML), where known
Per node:
    gputrace_budget_ratio, gputrace_probe_cost_seconds{kind, call}, gputrace_processes{state}, gputrace_info

The counters are the sampled rates (each process's recent intervals pooled, as `top` shows them)
times the time between frames, from the first frame that measured the process: estimates, as the
rates are. A figure that was never measured has no series (never a 0); a process that exits loses
all of its series at the next frame, so the series count is bounded by the processes alive.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gputrace import __version__
from gputrace.hostview.model import HostSnapshot, ProcessRow
from gputrace.tracer.audit import PRESETS
from gputrace.tracer.calibrate import Calibration

PROCESS_LABELS = ("pid", "comm", "runtime", "container_id", "pod_uid", "pod", "namespace", "workload")


@dataclass
class _Process:
    labels: tuple[str, ...]
    last_t: float                                   # the frame that last carried it
    calls: dict[str, float] = field(default_factory=dict)         # class -> estimated calls
    unknown_s: dict[str, float] = field(default_factory=dict)     # class -> seconds its rate was not known
    functions: dict[tuple[str, str], float] = field(default_factory=dict)  # (function, class) -> calls
    driver_cpu_s: float | None = None
    wait_s: float | None = None
    tracer_s: float | None = None
    slowdown: dict[tuple[str, str], float] = field(default_factory=dict)  # (preset, bound) -> ratio
    gpu_memory: dict[int, int] = field(default_factory=dict)  # GPU index -> bytes it holds there


def _labels(r: ProcessRow) -> tuple[str, ...]:
    i = r.identity
    return (str(r.pid), r.comm, i.runtime, i.container_id, i.pod_uid, i.pod, i.namespace, i.workload)


def _add(total: float | None, rate: float | None, dt: float) -> float | None:
    if rate is None:
        return total
    return (total or 0.0) + rate * dt


class FleetMetrics:
    """Accumulates frames (`update`, from the source's thread) and is a prometheus_client collector
    (`collect`, from the HTTP server's threads)."""

    def __init__(self, per_function: int = 0, presets: tuple[str, ...] = tuple(PRESETS)) -> None:
        self.per_function = per_function
        self.presets = presets
        self._lock = threading.Lock()
        self._procs: dict[int, _Process] = {}
        self._node: dict[str, object] = {}
        self.frames = 0

    def update(self, frame: HostSnapshot, calibration: Calibration | None = None) -> None:
        with self._lock:
            self.frames += 1
            present = {r.pid for r in frame.processes} | set(frame.pending)
            for pid in list(self._procs):
                if pid not in present:  # exited (or no longer mapping libcuda): its series go
                    del self._procs[pid]
            held = {}
            for g in frame.gpus:
                for pid, used in g.processes:
                    if used is not None:
                        held.setdefault(pid, {})[g.index] = used
            for r in frame.processes:
                self._row(r, frame.t)
                self._procs[r.pid].gpu_memory = held.get(r.pid, {})
            for pid in frame.pending:
                p = self._procs.get(pid)
                if p is not None:
                    p.last_t = frame.t  # not measured in this span: nothing is added for it
            noted = set()
            for note in frame.notes:
                head = note.split(":", 1)[0]
                if head.startswith("pid ") and head[4:].isdigit():
                    noted.add(int(head[4:]))
            self._node = {"budget": frame.budget, "calibration": calibration, "traced": len(frame.processes),
                          "pending": len(frame.pending), "untraceable": len(noted - present), "host": frame.host}

    def _row(self, r: ProcessRow, t: float) -> None:
        s = r.snapshot
        p = self._procs.get(r.pid)
        labels = _labels(r)
        if p is None or p.labels != labels:  # new, or a pid reused by another command
            p = self._procs[r.pid] = _Process(labels, t)
        dt, p.last_t = max(0.0, t - p.last_t), t
        if s.not_measured is not None:
            return
        # A rate not known adds nothing (tracer/model.py, unknown_reason): a counter is no place for
        # a figure that could be off by more than half.
        for c in s.classes:
            if c.not_known:
                p.unknown_s[c.cls.value] = p.unknown_s.get(c.cls.value, 0.0) + dt
                continue
            p.calls[c.cls.value] = p.calls.get(c.cls.value, 0.0) + c.rate_hz * dt
        p.driver_cpu_s = _add(p.driver_cpu_s, s.driver_cpu_s_per_s, dt)
        p.wait_s = _add(p.wait_s, s.wait_s_per_s, dt)
        p.tracer_s = _add(p.tracer_s, s.tracer_overhead, dt)
        for name in self.presets:
            a = r.audit(name)
            for bound, v in (("lower", a.slowdown_lower), ("upper", a.slowdown_upper)):
                if v is None:
                    p.slowdown.pop((name, bound), None)
                else:
                    p.slowdown[(name, bound)] = v
        if self.per_function:
            busiest = {f.name for f in sorted(s.functions, key=lambda f: f.rate_hz, reverse=True)[: self.per_function]}
            for f in s.functions:
                key = (f.name, f.cls.value)
                if f.not_known:
                    continue
                if key in p.functions or (f.name in busiest and len(p.functions) < 2 * self.per_function):
                    p.functions[key] = p.functions.get(key, 0.0) + f.rate_hz * dt

    # --- the collector ----------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        with self._lock:
            procs = [(p.labels, dict(p.calls), dict(p.functions), p.driver_cpu_s, p.wait_s, p.tracer_s,
                      dict(p.slowdown), dict(p.gpu_memory), dict(p.unknown_s)) for p in self._procs.values()]
            node = dict(self._node)
        calls = CounterMetricFamily("gputrace_process_driver_calls", "Driver calls, estimated from the sampled "
                                    "rates, by function class", labels=PROCESS_LABELS + ("class",))
        cpu = CounterMetricFamily("gputrace_process_driver_cpu_seconds", "Time spent in driver calls that do not "
                                  "wait for the GPU", labels=PROCESS_LABELS)
        wait = CounterMetricFamily("gputrace_process_wait_seconds", "Time blocked in driver calls that wait for the "
                                   "GPU (synchronization, synchronous copies)", labels=PROCESS_LABELS)
        tracer = CounterMetricFamily("gputrace_process_tracer_seconds", "Job time the tracer's probes cost the "
                                     "process", labels=PROCESS_LABELS)
        slow = GaugeMetricFamily("gputrace_process_predicted_slowdown_ratio", "The audit's bounds on the slowdown an "
                                 "interception layer would cause (preset: which layer; bound: lower hides in the "
                                 "wait, upper fully exposed)", labels=PROCESS_LABELS + ("preset", "bound"))
        funcs = CounterMetricFamily("gputrace_process_function_calls", "Calls of each process's busiest driver "
                                    "functions, estimated", labels=PROCESS_LABELS + ("function", "class"))
        unknown = CounterMetricFamily("gputrace_process_driver_calls_unknown_seconds", "Seconds in which a class's "
                                      "rate was not known (its 95% interval wider than half of it), whose calls "
                                      "gputrace_process_driver_calls leaves out", labels=PROCESS_LABELS + ("class",))
        gmem = GaugeMetricFamily("gputrace_process_gpu_memory_bytes", "Memory the process holds on each GPU, as "
                                 "NVML lists it", labels=PROCESS_LABELS + ("gpu",))
        for labels, c, fn, dcpu, w, tr, sl, gm, unk in procs:
            for cls, v in sorted(c.items()):
                calls.add_metric([*labels, cls], v)
            for cls, v in sorted(unk.items()):
                unknown.add_metric([*labels, cls], v)
            if dcpu is not None:
                cpu.add_metric(list(labels), dcpu)
            if w is not None:
                wait.add_metric(list(labels), w)
            if tr is not None:
                tracer.add_metric(list(labels), tr)
            for (preset, bound), v in sorted(sl.items()):
                slow.add_metric([*labels, preset, bound], v)
            for (name, cls), v in sorted(fn.items()):
                funcs.add_metric([*labels, name, cls], v)
            for gpu, used in sorted(gm.items()):
                gmem.add_metric([*labels, str(gpu)], used)
        yield from (calls, unknown, cpu, wait, tracer, slow, gmem)
        if self.per_function:
            yield funcs
        if not node:
            return
        yield GaugeMetricFamily("gputrace_budget_ratio", "The most the tracer may slow each process, as a share "
                                "of its time", value=node["budget"])
        cal = node["calibration"]
        if cal is not None:
            probe = GaugeMetricFamily("gputrace_probe_cost_seconds", "What a probe hit costs the traced thread, "
                                      "calibrated on this node (kind: how the kernel runs the probed instruction)",
                                      labels=("kind", "call"))
            for kind in ("emulated", "stepped"):
                c = cal.of(kind)
                probe.add_metric([kind, "counted"], c.entry_ns * 1e-9)
                probe.add_metric([kind, "timed"], c.entry_return_ns * 1e-9)
            yield probe
        procs_g = GaugeMetricFamily("gputrace_processes", "CUDA processes on the node: traced and measured, found "
                                    "but not measured yet, or not traceable", labels=("state",))
        for state in ("traced", "pending", "untraceable"):
            procs_g.add_metric([state], node[state])
        yield procs_g
        info = GaugeMetricFamily("gputrace_info", "The exporter", labels=("version", "host"))
        info.add_metric([__version__, str(node["host"])], 1)
        yield info
