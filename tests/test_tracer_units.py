"""The tracer's pure parts, no root or BPF needed: the budget policy, the audit's bounds, percentiles, the
--budget parser, probe kinds by first instruction, the renderers, and the header that user space mirrors."""

from __future__ import annotations

import io
import math
import random
import re
from pathlib import Path

import orjson
import pytest

from gputrace import report as rep
from gputrace.commands.attach import parse_budget
from gputrace.errors import UsageError
from gputrace.tracer import bpfprog
from gputrace.tracer.audit import PRESETS, audit, make_preset
from gputrace.tracer.budget import Policy
from gputrace.tracer.calibrate import Calibration, ProbeCost, probe_kind
from gputrace.tracer.classify import CLASS_ORDER, FunctionClass
from gputrace.tracer.model import ClassTotals, FunctionStats, Interval, ProcessSnapshot
from gputrace.tracer.session import percentile_ns

SUB, SYNC, STATE, QUERY = FunctionClass.SUBMISSION, FunctionClass.SYNC, FunctionClass.STATE, FunctionClass.QUERY
HEADER = Path(bpfprog.source_dir()) / "gputrace.h"


# --- budget.Policy -------------------------------------------------------------------------------------------------

CHEAP = ProbeCost(entry_ns=1000.0, entry_return_ns=3000.0, bias_ns=800.0)
STEPPED = ProbeCost(entry_ns=5000.0, entry_return_ns=8000.0, bias_ns=6000.0)


def policy(classes, costs, **kw) -> Policy:
    kw.setdefault("max_growth", None)  # the sizing tests check the optimum; growth is tested apart
    return Policy(classes, costs, rng=random.Random(7), **kw)


def test_window_grows_at_most_max_growth_per_interval():
    """An idle job makes long windows cheap; if it turns busy the next window must not be long already."""
    p = policy({0: QUERY}, {0: CHEAP}, budget=0.01, interval_s=1.0, max_growth=2.0)
    first = p.plan().window_s
    p.observe(first, {0: 1}, 1.0)  # next to no calls: the budget alone would allow the whole interval
    sizes = [first]
    for _ in range(4):
        plan = p.plan()
        sizes.append(plan.window_s)
        p.observe(plan.window_s, {0: 1}, 1.0)
    assert all(b <= 2.0 * a + 1e-12 for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1] > sizes[0]  # it does grow


def expected_cost_per_s(rates: dict[int, float], costs: dict[int, ProbeCost], timed: frozenset[int]) -> float:
    return sum(r * costs[f].cost_ns(f in timed) * 1e-9 for f, r in rates.items())


@pytest.mark.parametrize("budget, interval", [(0.01, 1.0), (0.05, 2.0), (0.2, 0.5)])
def test_first_window_is_a_budget_sized_scout(budget, interval):
    p = policy({0: SUB, 1: SYNC}, {0: CHEAP, 1: STEPPED}, budget=budget, interval_s=interval)
    plan = p.plan()
    assert plan.attach
    assert plan.window_s == pytest.approx(budget * interval)
    assert 0.0 <= plan.offset_s <= interval - plan.window_s
    assert plan.timed == frozenset({0, 1})  # nothing is known to be hot yet


def test_first_window_is_never_shorter_than_min_window():
    p = policy({0: SUB}, {0: CHEAP}, budget=0.001, interval_s=1.0, min_window_s=0.004)
    assert p.plan().window_s == pytest.approx(0.004)


@pytest.mark.parametrize("cpu", [1.0, 0.4, 1.7])
def test_planned_window_keeps_expected_cost_within_budget(cpu):
    classes = {0: SUB, 1: SYNC, 2: QUERY, 3: STATE}
    costs = {0: CHEAP, 1: STEPPED, 2: STEPPED, 3: CHEAP}
    budget, interval, scout = 0.01, 1.0, 0.01
    p = policy(classes, costs, budget=budget, interval_s=interval)
    p.plan()
    calls = {0: 200, 1: 60, 2: 10, 3: 3}  # 20 kHz, 6 kHz, 1 kHz, 300 Hz in the scout window
    p.observe(scout, calls, cpu)
    plan = p.plan()
    rates = {f: n / scout for f, n in calls.items()}
    # Hot, not synchronizing: counted only. The hot synchronization and the cold ones: timed.
    assert plan.timed == frozenset({1, 2, 3})
    per_s = expected_cost_per_s(rates, costs, plan.timed)
    allowed = budget * cpu * interval
    assert plan.attach and p.min_window_s < plan.window_s < interval  # neither clamp decides it
    assert plan.window_s * per_s <= allowed * (1 + 1e-9)
    assert plan.window_s == pytest.approx(allowed / per_s)  # and it uses the budget, not a fraction of it
    assert 0.0 <= plan.offset_s <= interval - plan.window_s


def test_cheap_calls_get_the_whole_interval():
    p = policy({0: QUERY}, {0: CHEAP}, budget=0.01, interval_s=1.0)
    p.plan()
    p.observe(0.01, {0: 1}, 1.0)  # 100 Hz x 3 µs = 0.03% of a second: the budget covers all of it
    plan = p.plan()
    assert plan.window_s == pytest.approx(1.0) and plan.offset_s == pytest.approx(0.0)


def test_a_rate_beyond_the_cpu_is_charged_at_most_the_cpu():
    """Probes cannot take more of an attached second than the target's CPU time: the window is then budget x
    interval, never shorter."""
    p = policy({0: SUB}, {0: STEPPED}, budget=0.01, interval_s=1.0)
    p.plan()
    p.observe(0.01, {0: 10_000}, 0.5)  # 1 MHz x 5 µs = 5 probe-seconds per second, on half a CPU
    assert p.plan().window_s == pytest.approx(0.01)


def test_hot_functions_are_timed_only_every_retime_window():
    classes = {0: SUB, 1: SYNC, 2: STATE}
    p = policy(classes, {f: CHEAP for f in classes}, budget=0.05, interval_s=1.0, retime_every=4, hot_hz=5000)
    timed = []
    for _ in range(9):
        plan = p.plan()
        timed.append(plan.timed)
        p.observe(0.01, {0: 1000, 1: 1000, 2: 10}, 1.0)  # 100 kHz, 100 kHz, 1 kHz
    everything, cold_or_sync = frozenset(classes), frozenset({1, 2})
    assert timed == [everything] + [cold_or_sync] * 3 + [everything] + [cold_or_sync] * 3 + [everything]


def test_windows_are_spread_out_when_even_the_shortest_costs_too_much():
    budget, interval, min_window, cpu = 0.006, 0.1, 0.002, 1.0
    p = policy({0: SUB}, {0: CHEAP}, budget=budget, interval_s=interval, min_window_s=min_window)
    p.plan()
    p.observe(0.001, {0: 2000}, cpu)  # 2 MHz: the probes would saturate the CPU while attached
    plans = [p.plan() for _ in range(8)]
    attached = [i for i, pl in enumerate(plans) if pl.attach]
    assert attached[0] == 0 and len(attached) >= 2
    cycle = attached[1] - attached[0]
    assert attached == list(range(0, 8, cycle))
    assert all(pl.window_s == pytest.approx(min_window) for pl in plans if pl.attach)
    assert all(pl.window_s == 0.0 for pl in plans if not pl.attach)
    # One min_window every `cycle` intervals stays within the budget; one interval fewer would not.
    per_s = min(expected_cost_per_s({0: 2e6}, {0: CHEAP}, frozenset()), cpu)
    allowed = budget * cpu * interval
    assert min_window * per_s / cycle <= allowed
    assert min_window * per_s / (cycle - 1) > allowed


def test_exact_plans_the_full_interval_every_time():
    classes = {0: SUB, 1: SYNC}
    p = policy(classes, {0: STEPPED, 1: STEPPED}, budget=1.0, interval_s=0.5)
    for _ in range(6):
        plan = p.plan()
        assert (plan.attach, plan.offset_s, plan.window_s) == (True, 0.0, 0.5)
        assert plan.timed == frozenset(classes)  # however hot: every call counted and timed
        p.observe(0.5, {0: 1_000_000, 1: 10}, 1.0)


# --- audit ---------------------------------------------------------------------------------------------------------

def fstats(name: str, cls: FunctionClass, rate: float, mean_ns: float | None = 1000.0) -> FunctionStats:
    return FunctionStats(name=name, cls=cls, calls_observed=int(rate), calls_estimated=rate, rate_hz=rate,
                         rate_err_hz=0.0, timed_calls=int(rate) if mean_ns is not None else 0, mean_ns=mean_ns,
                         outer_mean_ns=mean_ns, p50_ns=None, p99_ns=None)


RATES = {"cuLaunchKernel": (SUB, 12_000.0), "cuMemAlloc_v2": (STATE, 300.0),
         "cuStreamSynchronize": (SYNC, 500.0), "cuCtxGetDevice_v2": (QUERY, 90_000.0)}


def snapshot(wait: float, target_cpu_s: float | None = 0.8, tracer_cost_s: float = 0.002) -> ProcessSnapshot:
    return ProcessSnapshot(pid=4242, comm="train", interval_s=1.0, window_s=0.1, target_cpu_s=target_cpu_s,
                           functions=tuple(fstats(n, c, r) for n, (c, r) in RATES.items()),
                           tracer_cost_s=tracer_cost_s, driver_cpu_s_per_s=0.3, wait_s_per_s=wait)


@pytest.mark.parametrize("wait", [0.0, 0.0004, 0.5])
@pytest.mark.parametrize("preset", [make_preset("shim"), make_preset("proxy"), make_preset("shim", 250.0),
                                    make_preset("proxy", None, frozenset({QUERY}))])
def test_audit_bounds(preset, wait):
    a = audit(snapshot(wait), preset)
    rate = sum(r for c, r in RATES.values() if c in preset.classes)
    assert a.intercepted_hz == pytest.approx(rate)
    assert a.calls_hz == pytest.approx(sum(r for _, r in RATES.values()))  # every call, intercepted or not
    upper = rate * preset.cost_ns * 1e-9
    assert a.slowdown_upper == pytest.approx(upper) and a.added_cpu_s_per_s == pytest.approx(upper)
    assert a.slowdown_lower == pytest.approx(max(0.0, upper - wait))
    assert 0.0 <= a.slowdown_lower <= a.slowdown_upper
    assert a.wait_s_per_s == wait and a.cost_ns == preset.cost_ns
    assert set(a.classes) == {c.value for c in preset.classes}
    assert a.tracer_overhead == pytest.approx(0.002 / 0.8)


def test_audit_presets_and_overrides():
    assert PRESETS["shim"].classes == frozenset({SUB, STATE})
    assert PRESETS["proxy"].classes == frozenset(CLASS_ORDER)
    assert make_preset("shim") is PRESETS["shim"]
    given = make_preset("shim", 250.0)
    assert given.cost_ns == 250.0 and given.cost_source == "given with --cost-ns"
    assert given.classes == PRESETS["shim"].classes
    assert audit(snapshot(0.0, target_cpu_s=None), given).tracer_overhead is None  # not measured, not zero


# --- percentiles -----------------------------------------------------------------------------------------------------

def hist(**slots: int) -> tuple[int, ...]:
    h = [0] * bpfprog.HIST_SLOTS
    for k, n in slots.items():
        h[int(k[1:])] = n
    return tuple(h)


def test_percentile_of_nothing_is_not_measured():
    assert percentile_ns((0,) * bpfprog.HIST_SLOTS, 0.5) is None
    assert percentile_ns((), 0.99) is None


@pytest.mark.parametrize("h, q, want", [
    (hist(s10=1), 0.5, 2.0 ** 10),                # a bucket's upper edge: a bound
    (hist(s0=4), 0.99, 0.0),                      # slot 0 holds zero-length calls
    (hist(s3=50, s12=50), 0.5, 2.0 ** 3),
    (hist(s3=50, s12=50), 0.51, 2.0 ** 12),
    (hist(s3=98, s12=1, s20=1), 0.99, 2.0 ** 12),
    (hist(s3=98, s12=1, s20=1), 1.0, 2.0 ** 20),
    (hist(s39=3), 0.5, 2.0 ** 39),                # the open last slot
])
def test_percentile_ns(h, q, want):
    assert percentile_ns(h, q) == want


# --- --budget --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [("1%", 0.01), ("0.5%", 0.005), (" 2.5% ", 0.025), ("100%", 1.0),
                                        ("0.005", 0.005), ("1", 1.0), ("1e-3", 0.001)])
def test_parse_budget(text, want):
    assert parse_budget(text) == pytest.approx(want)


@pytest.mark.parametrize("text", ["", "%", "abc", "1%%", "0", "0%", "-1%", "101%", "1.5", "nan", "inf"])
def test_parse_budget_rejects(text):
    with pytest.raises(UsageError) as e:
        parse_budget(text)
    assert e.value.exit_code == 2 and e.value.hint


# --- probe kinds -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code, kind", [
    (b"\x55\x48\x89\xe5", "emulated"),      # push %rbp
    (b"\x53", "emulated"),                  # push %rbx
    (b"\x41\x57", "emulated"),              # push %r15
    (b"\x41\x54", "emulated"),              # push %r12
    (b"\xe8\0\0\0\0", "emulated"),          # call
    (b"\xe9\0\0\0\0", "emulated"),          # jmp
    (b"\xeb\x00", "emulated"),              # jmp short
    (b"\x90", "emulated"),                  # nop
    (b"\x74\x05", "emulated"),              # je short
    (b"\x0f\x85\0\0\0\0", "emulated"),      # jne near
    (b"\xf3\x0f\x1e\xfa", "stepped"),       # endbr64
    (b"\x48\x89\xf8", "stepped"),           # mov %rdi,%rax
    (b"\x41\x89\xf8", "stepped"),           # mov %edi,%r8d: REX.B, not a push
    (b"\x0f\x1f\x44\x00\x00", "stepped"),   # nopl: multi-byte nop, not emulated
    (b"\x31\xc0", "stepped"),               # xor %eax,%eax
    (b"\x58", "stepped"),                   # pop %rax
])
def test_probe_kind(tmp_path, code, kind):
    f = tmp_path / "lib.so"
    pad = b"\x55" * 37  # a push right before the function: the kind must come from the offset given
    f.write_bytes(pad + code + b"\xc3")
    assert probe_kind(f, len(pad)) == kind


def test_probe_kind_at_the_end_of_a_file(tmp_path):
    f = tmp_path / "lib.so"
    f.write_bytes(b"\x31\xc0\x41")
    assert probe_kind(f, 2) == "stepped"  # a lone REX prefix: not enough to call it a push
    assert probe_kind(f, 3) == "stepped"


# --- renderers -------------------------------------------------------------------------------------------------------

CALIBRATION = Calibration(emulated=ProbeCost(1200.0, 2500.0, 1000.0, 0.05),
                          stepped=ProbeCost(5600.0, 7600.0, 6000.0, 0.04), base_ns=2.5, rounds=5,
                          calls_per_round=3000)


def make_report(*, exact: bool = False, errors: dict[str, int] | None = None, extra_functions: int = 0) -> rep.Report:
    funcs = [fstats(n, c, r) for n, (c, r) in RATES.items()]
    funcs.append(fstats("cuModuleLoadData", STATE, 2.0, mean_ns=None))  # counted, never timed
    funcs += [fstats(f"cuExtra{i:02d}", QUERY, 1.0) for i in range(extra_functions)]
    summary = ProcessSnapshot(
        pid=4242, comm="train", interval_s=10.0, window_s=10.0 if exact else 0.5, target_cpu_s=8.0,
        functions=tuple(funcs), tracer_cost_s=0.016, driver_cpu_s_per_s=0.31, wait_s_per_s=0.004,
        classes=tuple(ClassTotals(c, sum(f.rate_hz for f in funcs if f.cls is c), 0.01) for c in CLASS_ORDER),
    )
    iv_snap = ProcessSnapshot(pid=4242, comm="train", interval_s=1.0, window_s=0.5, target_cpu_s=0.8,
                              functions=tuple(funcs), tracer_cost_s=0.0016, driver_cpu_s_per_s=0.31,
                              wait_s_per_s=0.004)
    intervals = (Interval(0, 0.0, 1.0, 0.5, (iv_snap,), {}), Interval(1, 1.0, 1.0, 0.5, (iv_snap,), {}))
    return rep.Report(
        pid=4242, comm="train", library="/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        command=("python", "train.py"), exit_status=0,
        options={"interval_s": 1.0, "budget": 1.0 if exact else 0.01, "exact": exact, "functions": [],
                 "attach_mode": "multi"},
        calibration=CALIBRATION,
        attach={"mode": "multi", "functions": 5, "windows": 10, "attach_s_median": 0.009,
                "detach_s_median": 0.07, "stepped_functions": 3},
        summary=summary,
        audits=tuple(audit(summary, p) for p in PRESETS.values()),
        intervals=intervals,
        errors={n: 0 for n in bpfprog.ERROR_NAMES} | (errors or {}),
    )


def render(r: rep.Report, name: str = "text") -> str:
    out = io.StringIO()
    rep.get(name).final(r, out)
    return out.getvalue()


def test_text_report_key_lines():
    r = make_report(errors={"depth": 3, "unpaired": 7, "stale": 2})
    text = render(r)
    lines = text.splitlines()
    assert lines[0] == "gputrace audit of pid 4242 (train) `python train.py`"
    assert "  libcuda            /usr/lib/x86_64-linux-gnu/libcuda.so.1" in lines
    assert "  traced             10.0 s; probes attached 5.0% of it (sampled windows, budget 1.0% of its CPU)" in lines
    assert any(ln.startswith("  probe cost         1.20 µs a counted call, 2.50 µs a timed call")
               and ln.endswith("(emulated first instruction)") for ln in lines)
    assert any(ln.startswith("  probe cost         5.60 µs") and ln.endswith("(stepped first instruction)")
               for ln in lines)
    assert "  tracer's own cost  0.20% of the process's CPU time (16.00 ms over 8.00 CPU-s)" in lines
    assert "  command exited     with status 0" in lines
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.startswith("  cu")}
    assert rows["cuCtxGetDevice_v2"][1:3] == ["query", "90.0k"]
    assert rows["cuModuleLoadData"][-2:] == ["-", "-"]  # never timed: no mean, no p99
    for a in r.audits:
        assert f"  - {a.preset}: intercepts {', '.join(a.classes)} at {rep.fmt_ns(a.cost_ns)} a call" in text
        assert (f"predicted slowdown between {rep.fmt_pct(a.slowdown_lower)} (hidden in the wait) "
                f"and {rep.fmt_pct(a.slowdown_upper)} (fully exposed)") in text
    # Unpaired returns and stale frames come with every window edge; only real trouble is noted.
    assert "  tracer notes: depth 3" in lines


def test_text_report_exact_and_clean():
    text = render(make_report(exact=True))
    assert "probes attached 100.0% of it (every call (exact))" in text
    assert "tracer notes" not in text


def test_text_report_shows_the_top_functions_only():
    r = make_report(extra_functions=30)
    text = render(r)
    shown = rep.TextRenderer.top_functions
    assert f"  ... and {len(r.summary.functions) - shown} more (all of them with --json)" in text
    assert sum(ln.startswith("  cu") for ln in text.splitlines()) == shown


def test_text_interval_line():
    r = make_report()
    out = io.StringIO()
    rep.get("text").interval(r.intervals[1], out)
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    assert line.startswith("[    1.0s] pid 4242 train: ")
    assert f"{rep.fmt_rate(r.intervals[1].processes[0].calls_hz)} calls/s" in line
    assert "probed 50% of the interval" in line and "tracer 0.20% of its CPU" in line


def test_json_report_parses_with_its_schema():
    r = make_report(errors={"depth": 1})
    doc = orjson.loads(render(r, "json"))
    assert doc["schema"] == rep.SCHEMA
    assert set(doc) == {"schema", "kind", "pid", "comm", "library", "command", "exit_status", "options",
                        "calibration", "attach", "summary", "audits", "errors", "intervals"}
    assert doc["kind"] == "gputrace.attach" and doc["command"] == ["python", "train.py"]
    s = doc["summary"]
    assert s["calls_hz"] == pytest.approx(r.summary.calls_hz)
    assert s["tracer_overhead"] == pytest.approx(0.016 / 8.0)
    funcs = {f["name"]: f for f in s["functions"]}
    assert funcs["cuLaunchKernel"]["cls"] == "submission"
    assert funcs["cuModuleLoadData"]["mean_ns"] is None  # not measured: null, not 0
    assert [a["preset"] for a in doc["audits"]] == list(PRESETS)
    assert doc["errors"]["depth"] == 1
    assert len(doc["intervals"]) == 2 and doc["intervals"][1]["processes"][0]["pid"] == 4242
    assert doc["calibration"]["stepped"]["entry_ns"] == 5600.0
    assert rep.report_dict(r, with_intervals=False)["intervals"] == []


def test_renderers_come_from_the_registry():
    assert set(rep.RENDERERS) >= {"text", "json"}
    assert isinstance(rep.get("json"), rep.JsonRenderer)


# --- the header user space mirrors ---------------------------------------------------------------------------------

def header_defines() -> dict[str, str]:
    return dict(re.findall(r"^#define\s+(GT_\w+)\s+(\S+)", HEADER.read_text(), re.M))


def test_header_matches_bpfprog():
    d = header_defines()
    assert int(d["GT_HIST_SLOTS"]) == bpfprog.HIST_SLOTS == len(bpfprog.ZERO.hist)
    assert int(d["GT_MAX_DEPTH"]) == bpfprog.MAX_DEPTH
    assert bpfprog.MAX_DEPTH & (bpfprog.MAX_DEPTH - 1) == 0  # the BPF code masks with it
    text = HEADER.read_text()
    shift = re.search(r"^#define\s+GT_COOKIE_TIMED\s+\(1ULL << (\d+)\)", text, re.M)
    assert shift and 1 << int(shift.group(1)) == bpfprog.COOKIE_TIMED
    body = re.search(r"enum gt_error \{(.*?)\};", text, re.S).group(1)
    names = re.findall(r"GT_ERR_(\w+)", body)
    assert names[-1] == "COUNT"
    assert tuple(n.lower() for n in names[:-1]) == bpfprog.ERROR_NAMES


def test_rawstats_arithmetic():
    a = bpfprog.RawStats(10, 8, 800, 600, 2, 1, hist(s3=5, s9=3))
    b = bpfprog.RawStats(4, 3, 300, 200, 1, 0, hist(s3=2, s9=1))
    assert a - b == bpfprog.RawStats(6, 5, 500, 400, 1, 1, hist(s3=3, s9=2))
    assert (a - b) + b == a
    assert a - bpfprog.ZERO == a
    assert math.isclose(sum((a - b).hist), (a - b).timed)


def test_probes_everything_until_something_is_seen():
    """Windows before the job's first driver call see nothing: the next must not probe nothing."""
    p = policy({0: QUERY, 1: SUB}, {0: CHEAP, 1: CHEAP}, budget=0.01, interval_s=1.0, rescan_every=30)
    for _ in range(17):  # past the young process's rescans (windows 1, 2, 4, 8, 16)
        p.observe(p.plan().window_s, {}, 1.0)
    assert p.plan().probe == frozenset({0, 1})
    p.observe(0.01, {1: 5}, 1.0)
    assert p.plan().probe == frozenset({1})  # once calls are seen, only those, until the next rescan


def test_a_young_process_is_rescanned_at_doubling_ages_then_every_rescan_every():
    """A job found while it starts up calls other functions in its loop: they must be found within
    twice its age, not only at the periodic rescan."""
    p = policy({0: QUERY, 1: SUB}, {0: CHEAP, 1: CHEAP}, budget=0.01, interval_s=1.0, rescan_every=30)
    rescans = []
    for k in range(61):
        rescans.append(p.plan().probe == frozenset({0, 1}))
        p.observe(0.01, {1: 100}, 0.5)
    assert [k for k, r in enumerate(rescans) if r] == [0, 1, 2, 4, 8, 16, 30, 60]


def test_host_wide_rescans_follow_each_members_age_not_the_sessions():
    """A process that joins a long-running host session gets its own young rescans."""
    from gputrace.tracer.budget import AlignedPolicy

    host = AlignedPolicy({0: QUERY, 1: SUB}, {0: CHEAP, 1: CHEAP}, budget=0.01, interval_s=1.0, rescan_every=30,
                         max_growth=None, rng=random.Random(7))
    host.members[1] = policy({0: QUERY, 1: SUB}, {0: CHEAP, 1: CHEAP}, budget=0.01, interval_s=1.0)
    rescans = []
    for k in range(61):
        if k == 40:
            host.members[2] = policy({0: QUERY, 1: SUB}, {0: CHEAP, 1: CHEAP}, budget=0.01, interval_s=1.0)
            host.rescan_soon()  # as HostSession._admit does
        plan = host.plan()
        rescans.append(plan.probe == frozenset({0, 1}))
        for m in host.members.values():
            m.observe(plan.window_s, {1: 100}, 0.5)
        host.merge(plan.window_s)
    assert [k for k, r in enumerate(rescans) if r] == [0, 1, 2, 4, 8, 16, 30, 40, 41, 42, 44, 48, 56, 60]


def test_marker_waits_for_a_measured_cpu_time_and_fits_a_quarter_of_the_budget():
    p = policy({0: QUERY, 1: SUB}, {0: CHEAP, 1: CHEAP}, budget=0.01, interval_s=1.0)
    p.observe(0.01, {0: 50, 1: 5}, None)  # 5 kHz and 500 Hz
    assert p.choose_marker(None) is None and p.choose_marker(0.0) is None  # a tick too coarse to say
    cpu = 0.5
    m = p.choose_marker(cpu)
    assert m is not None and p.marker_cost(m) <= 0.01 * cpu / 4
    # The most-called function that fits: a heavier one that fits is chosen over a lighter one.
    assert all(p.marker_cost(f) > 0.01 * cpu / 4 or p.rates[f] <= p.rates[m] for f in (0, 1))


# --- budget.AlignedPolicy (host-wide windows) -----------------------------------------------------------------------

def aligned(members: dict[int, tuple[float, float]]):
    """An AlignedPolicy over one SUB function, members pid -> (calls/s, CPU s/s), each past its scout window."""
    from gputrace.tracer.budget import AlignedPolicy

    host = AlignedPolicy({0: SUB}, {0: CHEAP}, budget=0.01, interval_s=1.0, max_growth=None, rng=random.Random(7))
    for pid, (rate, cpu) in members.items():
        p = policy({0: SUB}, {0: CHEAP}, budget=0.01, interval_s=1.0)
        p.plan()
        p.observe(0.01, {0: int(rate * 0.01)}, cpu)
        host.members[pid] = p
    host.plan()  # the host's own scout
    host.merge(0.01)
    return host


def test_aligned_window_is_the_least_any_member_affords():
    host = aligned({1: (10_000.0, 0.5), 2: (1_000.0, 0.5), 3: (50_000.0, 1.0)})
    plan = host.plan()
    own = {pid: p.affordable_s(plan.timed) for pid, p in host.members.items()}
    assert plan.window_s == pytest.approx(min(own.values()))
    for pid, p in host.members.items():  # no member's expected cost exceeds its budget
        assert p.cost_per_s(plan.timed) * plan.window_s <= 0.01 * p.cpu_s_per_s * 1.0 + 1e-12, pid


def test_a_member_measured_at_zero_cpu_pauses_windows_but_not_for_good():
    host = aligned({1: (1_000.0, 0.5), 2: (1_000.0, 0.0)})
    plans = [host.plan() for _ in range(3 * (host.max_skip + 1))]
    attached = [i for i, pl in enumerate(plans) if pl.attach]
    assert len(attached) >= 2 and attached[0] <= host.max_skip
    assert all(b - a <= host.max_skip + 1 for a, b in zip(attached, attached[1:]))
    assert len(attached) < len(plans) / 2  # it does pause


def test_the_shared_marker_fits_every_members_budget():
    # Function 0 at 20k calls/s costs member 2 (a light job) more than a quarter of its budget: no marker.
    host = aligned({1: (20_000.0, 1.0), 2: (20_000.0, 0.05)})
    assert host.choose_marker() is None
    host = aligned({1: (200.0, 1.0), 2: (100.0, 0.5)})
    assert host.choose_marker() == 0
    assert all(p.reserved_s_per_s == pytest.approx(p.marker_cost(0)) for p in host.members.values())
    host.members[2].cpu_s_per_s = 0.001  # member 2 got lighter: the marker now costs it over half its budget
    assert host.marker_too_dear(0)


def bare_tracee(functions: dict, entry_ns: float = 1.0):
    """A Tracee over `functions` ({id: (name, class)}) and the parts of a Probes it reads: no program,
    no links; every function probed. Returns (tracee, probes) and starts its first interval."""
    import os
    import types

    from gputrace.tracer.symbols import Function
    from gputrace.tracer.tracee import Tracee

    cost = ProbeCost(entry_ns=entry_ns, entry_return_ns=3 * entry_ns, bias_ns=0.0)
    cal = Calibration(cost, cost, 10.0, 1, 1)
    ids = {f: Function(name, 0x1000 * (f + 1), 0x1000 * (f + 1), 16, cls) for f, (name, cls) in functions.items()}
    probes = types.SimpleNamespace(ids=ids, classes={f: cls for f, (_, cls) in functions.items()},
                                   costs=dict.fromkeys(functions, cost), calibration=cal, probed=frozenset(functions))
    t = Tracee(os.getpid(), probes, budget=0.01, interval_s=1.0, exact=False, own_marker=False)
    t.begin()
    return t, probes


def test_recent_pools_the_last_intervals_of_a_process():
    """What top shows each refresh: the last 5 intervals pooled, not the last window alone."""
    from gputrace.tracer.bpfprog import ZERO, RawStats

    t, _ = bare_tracee({0: ("cuLaunchKernel", SUB)}, entry_ns=1000.0)
    cum = ZERO
    for k, calls in enumerate([0, 100, 0, 100, 0, 100, 0]):  # a bursty job: every other window sees nothing
        cum = cum + RawStats(calls, 0, 0, 0, 0, 0, ZERO.hist)
        snap = t.account(1.0, 0.01, {0: cum}, 0.0)
        assert snap.calls_hz == pytest.approx(calls / 0.01, rel=0.05)  # one interval: 0 or 10k calls/s
    recent = t.recent()
    # The last 5 intervals: 200 calls in 5 windows of 10 ms (taking the probe time out of them).
    assert recent.interval_s == pytest.approx(5.0) and recent.window_s == pytest.approx(0.05)
    assert recent.calls_hz == pytest.approx(200 / 0.05, rel=0.05)
    # An interval without a window: the last recent snapshot stands, the very object; after one
    # with a window, a new one with its calls.
    assert t.recent(rebuild=False) is recent
    t.account(1.0, 0.0, {0: cum}, 0.0, snapshot=False)
    assert t.recent(rebuild=False) is recent
    cum = cum + RawStats(300, 0, 0, 0, 0, 0, ZERO.hist)
    t.account(1.0, 0.01, {0: cum}, 0.0, snapshot=False)
    fresh = t.recent(rebuild=True)
    assert fresh is not recent and fresh.calls_hz > recent.calls_hz


def test_summary_weighs_windows_by_the_span_they_stand_for_not_their_length():
    """Traced from its start, a job spends seconds in import and setup (few calls: the budget affords
    1 s windows), then loops at 300k calls/s (40 ms windows). The session's rate is its calls over
    its time: pooling counts over window length would read a fraction of it (seen on the H200: 70k
    calls/s for a job whose intervals read 250-330k). An interval without a window counts towards
    the span of the window before it, which was sized for it. A function not probed in a window
    (never seen called before it: only those are left out) counts as not called there."""
    from gputrace.tracer.bpfprog import ZERO, RawStats

    # Probes cost next to nothing: no probe time to take out of the windows.
    t, probes = bare_tracee({0: ("cuDeviceGetAttribute", QUERY), 1: ("cuCtxGetDevice_v2", SUB)})
    a = b = ZERO
    for k in range(10):  # setup: 1 s windows, 100 calls/s of one function; after the first, only it is probed
        probes.probed = frozenset({0, 1}) if k == 0 else frozenset({0})
        a = a + RawStats(100, 0, 0, 0, 0, 0, ZERO.hist)
        t.account(1.0, 1.0, {0: a, 1: b}, 0.0, snapshot=False)
    probes.probed = frozenset({0, 1})  # a rescan found the loop's function
    for _ in range(10):  # the loop: a 40 ms window every other interval (host-wide), 300k calls/s
        b = b + RawStats(12_000, 0, 0, 0, 0, 0, ZERO.hist)
        t.account(1.0, 0.04, {0: a, 1: b}, 0.0, snapshot=False)
        t.account(1.0, 0.0, None, 0.0, snapshot=False)
    s = t.summary()
    assert s.interval_s == pytest.approx(30.0)
    rates = {f.name: f for f in s.functions}
    # 300k/s for 20 of the 30 s: 200k/s (pooled by window length: 120k calls in 10.4 s, 11.5k/s;
    # over the windows that probed it alone: 300k x 20 / 21, 286k/s).
    f = rates["cuCtxGetDevice_v2"]
    assert f.rate_hz == pytest.approx(6_000_000 / 30.0, rel=0.01)
    assert f.calls_estimated == pytest.approx(6_000_000, rel=0.01)
    # From window to window the rate changed once (0 to 300k): an uncertainty of about 11%, where the
    # windows' spread around their mean (0 and 300k about 200k) would say 33%.
    assert 0 < f.rate_err_hz < 0.2 * f.rate_hz
    assert rates["cuDeviceGetAttribute"].rate_hz == pytest.approx(1000 / 30.0, rel=0.01)


def test_recent_weighs_windows_by_their_span_as_the_summary_does():
    """The live rows' last 5 intervals: 1 s of setup in a 1 s window (nothing called), then 4 of a
    loop at 300k calls/s in 40 ms windows, read 240k (4 x 300k / 5), not the 41k that pooling counts
    over window length gives (48k calls in 1.16 s)."""
    from gputrace.tracer.bpfprog import ZERO, RawStats

    t, _ = bare_tracee({0: ("cuCtxGetDevice_v2", SUB)})
    cum = ZERO
    t.account(1.0, 1.0, {0: cum}, 0.0, snapshot=False)
    for _ in range(4):
        cum = cum + RawStats(12_000, 0, 0, 0, 0, 0, ZERO.hist)
        t.account(1.0, 0.04, {0: cum}, 0.0, snapshot=False)
    assert t.recent().calls_hz == pytest.approx(240_000, rel=0.01)


def test_a_window_every_other_interval_twice_as_long_within_the_same_budget():
    one = policy({0: SUB}, {0: CHEAP}, budget=0.01, interval_s=1.0, max_growth=None)
    two = policy({0: SUB}, {0: CHEAP}, budget=0.01, interval_s=1.0, max_growth=None, every=2)
    for p in (one, two):
        p.observe(0.01, {0: 1000}, 0.5)
    plans = [two.plan() for _ in range(4)]
    assert [p.attach for p in plans] == [True, False, True, False]
    w1 = one.plan().window_s
    assert plans[0].window_s == pytest.approx(2 * w1) and plans[2].window_s == pytest.approx(2 * w1)
    assert plans[1].probe == frozenset()  # nothing attached, no rescan used up


def test_a_process_joining_makes_the_next_window_a_rescan():
    p = policy({0: QUERY, 1: SUB}, {0: CHEAP, 1: CHEAP}, budget=0.01, interval_s=1.0, rescan_every=30)
    for _ in range(17):  # past its own young rescans
        p.observe(0.01, {1: 100}, 0.5)
    assert p.plan().probe == frozenset({1})
    p.rescan_soon()
    assert p.plan().probe == frozenset({0, 1})
    assert p.plan().probe == frozenset({1})


def test_p50_p99_in_one_pass_equals_percentile_ns():
    from gputrace.tracer.tracee import p50_p99_ns

    rng = random.Random(3)
    for _ in range(200):
        h = tuple(rng.choice([0, 0, 0, 1, 5, 100]) for _ in range(bpfprog.HIST_SLOTS))
        t = sum(h)
        assert p50_p99_ns(h, t) == (percentile_ns(h, 0.5, t), percentile_ns(h, 0.99, t))


def test_rawstats_arithmetic_round_trips():
    a = bpfprog.RawStats(10, 4, 1000, 900, 1, 2, tuple(range(bpfprog.HIST_SLOTS)), 3)
    b = bpfprog.RawStats(3, 1, 100, 90, 0, 1, tuple(1 for _ in range(bpfprog.HIST_SLOTS)), 1)
    assert (a - b) + b == a and a - a == bpfprog.ZERO and a + bpfprog.ZERO == a and bpfprog.ZERO + a == a
    assert (a - b).hist == tuple(x - 1 for x in range(bpfprog.HIST_SLOTS)) and (a - b).calls == 7
