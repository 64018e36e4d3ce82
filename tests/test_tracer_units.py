"""The tracer's pure parts, no root or BPF needed: the budget policy, the audit's bounds, percentiles, the
--budget parser, probe kinds by first instruction, the renderers, and the header that user space mirrors."""

from __future__ import annotations

import dataclasses
import json
import io
import math
import random
import re
from pathlib import Path

import orjson
import pytest

from gputrace import report as rep
from gputrace.base.units import fmt_ns, fmt_pct, fmt_rate
from gputrace.registry import parse_budget
from gputrace.base.errors import UsageError
from gputrace.tracer import bpfprog
from gputrace.tracer.audit import INDIRECT_MAX, PRESETS, audit, make_preset
from gputrace.tracer.budget import PLAN_SHARE, WRITE_S, Policy
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
    kw.setdefault("budget", 0.01)
    kw.setdefault("interval_s", 1.0)
    return Policy(classes, costs, rng=random.Random(7), **kw)


def scouted(classes, costs, calls: dict[int, int], scout_s: float = 0.005, **kw) -> Policy:
    """A Policy past its scout window, which counted `calls` in `scout_s` (rates taken as measured)."""
    p = policy(classes, costs, **kw)
    p.plan()
    p.observe(1, {f: n / scout_s for f, n in calls.items()}, calls)
    return p


def window_cost(p: Policy, plan) -> float:
    """What a plan's windows, references and breakpoint writes cost the job, at the policy's rates."""
    from gputrace.tracer.budget import WRITE_S

    per_window = min(1.0, p.exposure * expected_cost_per_s(
        {f: r for f, r in p.rates.items() if f in plan.probe}, p.costs, plan.timed))
    ref = 0.0 if plan.marker is None else min(1.0, p.exposure * p.rates[plan.marker] * p.costs[plan.marker].entry_ns * 1e-9)
    writes = len(plan.windows) * 2 * (len(plan.probe) + (plan.marker is not None)) * WRITE_S
    cost = sum(w * (per_window + ref) for _, w in plan.windows) + writes
    if plan.rare is not None:  # the rarer functions' own window
        cost += plan.rare[1] * min(1.0, p.exposure * expected_cost_per_s(
            {f: r for f, r in p.rates.items() if f in plan.rare_probe}, p.costs, plan.rare_timed))
        cost += 2 * (len(plan.rare_probe) + (plan.rare_marker is not None)) * WRITE_S
        if plan.rare_marker is not None:  # and its reference span
            cost += plan.rare[1] * min(1.0, p.exposure * p.rates[plan.rare_marker]
                                       * p.costs[plan.rare_marker].entry_ns * 1e-9)
    return cost


def expected_cost_per_s(rates: dict[int, float], costs: dict[int, ProbeCost], timed: frozenset[int]) -> float:
    return sum(r * costs[f].cost_ns(f in timed) * 1e-9 for f, r in rates.items())


@pytest.mark.parametrize("budget, interval", [(0.01, 1.0), (0.05, 2.0), (0.2, 0.5)])
def test_first_window_is_a_full_scan_half_the_budget_long(budget, interval):
    """Rates unknown: the scout's length alone bounds its cost (a job doing nothing but hit probes
    loses the window, no more), and the other half of the planned budget is for its edges."""
    p = policy({0: SUB, 1: SYNC}, {0: CHEAP, 1: STEPPED}, budget=budget, interval_s=interval)
    plan = p.plan()
    assert plan.attach and plan.full_scan and plan.probe == frozenset({0, 1})
    ((offset, w),) = plan.windows
    assert w == pytest.approx(PLAN_SHARE * budget * interval / 2) and offset == 0.0  # at once: nothing counts calls before it
    assert plan.timed == frozenset({1})  # counted probes cost least; the synchronization is timed for the wait
    assert p.watch_set() == frozenset({0, 1})  # nothing seen yet: everything stays watched


def test_after_the_scout_windows_probe_what_was_seen_and_the_rest_is_watched():
    p = scouted({0: SUB, 1: QUERY, 2: STATE}, {f: CHEAP for f in range(3)}, {0: 50})
    plan = p.plan()
    assert plan.probe == frozenset({0}) and p.watch_set() == frozenset({1, 2})
    p.see(2, 3000.0)  # the watch link saw it called: into the windows at once
    assert p.plan().probe == frozenset({0, 2}) and p.watch_set() == frozenset({1})


@pytest.mark.parametrize("exposure", [None, 0.5, 2.0])
def test_planned_windows_keep_their_expected_cost_within_the_budget_and_use_it(exposure):
    classes = {0: SUB, 1: SYNC, 2: QUERY, 3: STATE}
    costs = {0: CHEAP, 1: STEPPED, 2: STEPPED, 3: CHEAP}
    budget, interval = 0.01, 1.0
    # (No rare window: its first comes at once on the budget of the next few intervals; tested apart.)
    # (Windows of time: step windows are whole steps, at most what the budget pays; tested apart.)
    p = scouted(classes, costs, {0: 100, 1: 30, 2: 5, 3: 2}, budget=budget, interval_s=interval, rare_share=0.0,
                step_windows=False)
    p.observe_exposure(exposure)
    plan = p.plan()
    assert plan.attach and len(plan.windows) == 2
    assert plan.timed == frozenset(classes)  # the interval after the scout times everything
    # The windows spend the planned share; the rest of the budget is the margin for what plans miss.
    assert window_cost(p, plan) == pytest.approx(PLAN_SHARE * budget * interval, rel=1e-6)
    plan = p.plan()  # then the hot one that does not synchronize is only counted
    assert plan.timed == frozenset({1, 2, 3})
    assert window_cost(p, plan) <= PLAN_SHARE * budget * interval * (1 + 1e-9)


def test_two_windows_an_interval_one_in_each_half_with_room_for_their_references():
    # (Windows of time: at 4 kHz function 1 is cheap enough to keep as the step, and step windows
    # have no marker; tested apart.)
    p = scouted({0: SUB, 1: QUERY}, {0: CHEAP, 1: CHEAP}, {0: 300, 1: 40}, budget=0.05, interval_s=1.0,
                step_windows=False)
    for _ in range(20):
        plan = p.plan()
        assert plan.marker == 1  # 8 kHz at 1 us: its probes take 0.8% of its reference span; 50 kHz's 5% is the most
        (o1, w1), (o2, w2) = plan.windows
        assert w1 == w2 and 0.0 <= o1 - w1 and o1 + w1 <= 0.5 and 0.5 <= o2 - w2 and o2 + w2 <= 1.0


def test_the_marker_is_the_most_called_function_cheap_enough_to_be_a_reference():
    """The estimator reads windows against the marker's rate in its reference spans where its probes
    take at most REF_PROBE_MAX of them (estimator.reference_rates): the most-called such function."""
    from gputrace.tracer.estimator import REF_PROBE_MAX

    p = scouted({0: SUB, 1: QUERY, 2: STATE}, {f: CHEAP for f in range(3)}, {0: 400, 1: 20, 2: 2}, budget=0.05,
                interval_s=1.0)
    probe, timed = frozenset({0, 1, 2}), frozenset()
    assert p.choose_marker(probe, timed) == 1 and p.ref_share(1) <= REF_PROBE_MAX
    assert p.ref_share(0) > REF_PROBE_MAX  # the busiest: its own probes would slow its reference
    # Where none is that cheap, the most-called whose reference costs a quarter of the window at most
    # (the exposure's marker).
    p = scouted({0: SUB, 1: QUERY, 2: STATE}, {f: CHEAP for f in range(3)}, {0: 2000, 1: 400, 2: 300}, budget=0.05,
                interval_s=1.0)
    assert all(p.ref_share(f) > REF_PROBE_MAX for f in range(3))
    m = p.choose_marker(probe, timed)
    assert m == 1 and p.marker_cost_per_s(1) <= p.window_cost_per_s(probe, timed) / 4
    assert p.marker_cost_per_s(0) > p.window_cost_per_s(probe, timed) / 4  # the busiest would cost too much


def test_a_marker_is_chosen_where_the_unmeasured_exposure_makes_every_window_seem_to_stop_the_job():
    # The copy loop's scout on the H200 (audit round 5, run 9, copies' second attach; bench/HISTORY.md): four
    # functions counted in 3.2 ms with probes taking 1.8 ms of it; read at the unmeasured exposure's
    # middle (1.5) the window stood for 0.5 ms, so the rates came out about six times too high.
    calls = {0: 1260, 1: 463, 2: 132, 3: 67}  # cuCtxGetDevice_v2, ...PrimaryCtxGetState, IsCapturing, Sync
    emulated = ProbeCost(entry_ns=818.0, entry_return_ns=1438.0, bias_ns=540.0)
    p = scouted({0: QUERY, 1: QUERY, 2: QUERY, 3: SYNC}, {f: emulated for f in calls}, calls,
                scout_s=0.00053, budget=0.01, interval_s=1.0, rare_share=0.0)
    probe, timed = frozenset(calls), frozenset({3})
    assert p.window_cost_per_s(probe, timed) == 1.0  # every window seems to cost the job all its time
    assert not any(p.marker_fits(f, probe, timed) for f in calls)  # a quarter of "all of it": none
    m = p.choose_marker(probe, timed)
    assert m == 3  # the cheapest whose rate is a quarter of the window's at most
    assert p.marker_fits(m, probe, timed, strict=False) and p.marker_cost_per_s(3) < p.marker_cost_per_s(2)
    assert p.plan().marker == m  # and the plan takes it


def test_windows_span_whole_periods_of_the_slowest_kept_function():
    """A GPU-bound loop's calls come in a burst a step (on the H200: 133 in a 13.7-ms step, one
    cuMemcpyDtoHAsync each, kept): windows are whole steps long, stretched by what their probes slow
    the job, so each counts as many bursts as steps wherever it starts."""
    p = scouted({0: QUERY, 1: SUB, 2: QUERY}, {f: CHEAP for f in range(3)}, {0: 50, 1: 1, 2: 10}, budget=0.01,
                interval_s=1.0, rare_share=0.0)
    p.observe_kept({1: 73.0})
    assert p.kept == frozenset({1})
    for _ in range(5):
        plan = p.plan()
        period = p.period_s(p.window_cost_per_s(plan.probe, plan.timed))
        assert period > 1 / 73.0  # stretched by the window's own cost
        for _, w in plan.windows:
            assert w / period == pytest.approx(round(w / period), abs=1e-6) and round(w / period) >= 1
        assert window_cost(p, plan) <= PLAN_SHARE * 0.01 * (1 + 1e-9)  # never beyond the budget
        p.observe(len(plan.windows), {0: 10_000.0, 2: 2_000.0}, {0: 100, 2: 20})
        p.observe_kept({1: 73.0})


def test_a_window_the_growth_limit_holds_under_one_period_is_given_one_where_the_budget_pays():
    kw = dict(budget=0.02, interval_s=1.0, rare_share=0.0, max_growth=2.0)
    p = scouted({0: QUERY, 1: SUB, 2: QUERY}, {f: CHEAP for f in range(3)}, {0: 50, 1: 1, 2: 10}, **kw)
    p.observe_kept({1: 40.0})  # a 25-ms step
    last = p.last_window_s
    plan = p.plan()
    (_, w), _ = plan.windows
    assert w > 2 * last and w == pytest.approx(p.period_s(p.window_cost_per_s(plan.probe, plan.timed)))
    assert window_cost(p, plan) <= PLAN_SHARE * 0.02 * (1 + 1e-9)
    q = scouted({0: QUERY, 1: SUB, 2: QUERY}, {f: CHEAP for f in range(3)}, {0: 50, 1: 1, 2: 10}, keep_share=0.0, **kw)
    (_, w0), _ = q.plan().windows
    assert w0 <= 2 * q.scout_s() + 1e-12  # without a kept function the growth limit stands


def test_where_an_interval_pays_for_less_than_a_step_a_whole_step_comes_every_few_intervals():
    """A GPT-2 training step on the H200: 300k calls/s in bursts of one 15-ms step, and 1% of an
    interval paying for 3-ms windows, a fifth of a step each (the hottest functions then read
    -22..+21% after 5 s). A window of one whole step of every probed function, the rarer ones too,
    every few intervals, paid for by all of them, counts each burst of one step wherever it starts."""
    classes = {0: SUB, 1: SUB, 2: QUERY, 3: STATE}
    p = scouted(classes, {f: CHEAP for f in classes}, {0: 1500, 1: 1, 2: 20, 3: 10}, budget=0.01, interval_s=1.0)
    p.observe_exposure(1.0)
    p.observe_kept({1: 60.0})  # once a step
    assert p.kept == frozenset({1})
    whole = quiet = 0
    for _ in range(16):
        plan = p.plan()
        if not plan.windows:
            quiet += 1
            continue
        if plan.timed != frozenset(classes):  # (the interval that times every function plans as before)
            (_, w), = plan.windows
            period = p.period_s(p.window_cost_per_s(plan.probe, plan.timed))
            assert w == pytest.approx(period) and period > 1 / 60.0
            assert plan.probe == frozenset(p.seen) and plan.rare is None  # the rarer ones counted in it too
            k = p.skip + 1
            assert 2 <= k <= 3 and window_cost(p, plan) <= k * PLAN_SHARE * 0.01 * (1 + 1e-9)
            assert window_cost(p, plan) > (k - 1) * PLAN_SHARE * 0.01  # the fewest intervals that pay for it
            whole += 1
        p.observe(len(plan.windows), {0: 300_000.0, 2: 4_000.0, 3: 2_000.0}, {0: 900, 2: 12, 3: 6})
        p.observe_kept({1: 60.0})
    assert whole >= 3 and quiet >= whole - 1  # each followed by the intervals that paid for it
    # Where a step is so long that no few intervals pay for one, the windows stay as they were.
    q = scouted(classes, {f: CHEAP for f in classes}, {0: 1500, 1: 1, 2: 20, 3: 10}, budget=0.01, interval_s=1.0)
    q.observe_exposure(1.0)
    q.observe_kept({1: 4.0})
    for _ in range(4):
        plan = q.plan()
        assert len(plan.windows) == 2 and all(w < 1 / 4.0 for _, w in plan.windows)
        q.observe(2, {0: 300_000.0, 2: 4_000.0, 3: 2_000.0}, {0: 900, 2: 12, 3: 6})
        q.observe_kept({1: 4.0})


def test_counted_and_timed_windows_are_planned_at_their_own_exposures():
    """The estimator measures the exposure of windows that count the hot functions apart from that
    of windows that time every function (on the H200, GPT-2: 0.62 +- 0.62 and 1.68 +- 0.33): each
    kind is planned at its own, so the counted windows are not priced at the timed ones' factor."""
    classes = {0: QUERY, 1: SUB, 2: SUB}
    calls = {0: 1500, 1: 50, 2: 20}
    both = scouted(classes, {f: CHEAP for f in classes}, calls, rare_share=0.0, keep_share=0.0)
    own = scouted(classes, {f: CHEAP for f in classes}, calls, rare_share=0.0, keep_share=0.0)
    both.observe_exposure(2.0)
    own.observe_exposure(0.6, 2.0)
    seen = set()
    for _ in range(8):
        a, b = both.plan(), own.plan()
        assert a.timed == b.timed
        wa, wb = sum(w for _, w in a.windows), sum(w for _, w in b.windows)
        if a.timed >= a.probe:  # a window that times every function: the same exposure (its counted
            assert wb == pytest.approx(wa, rel=0.25)  # reference span aside), about the same plan
        else:
            assert wb > 2 * wa
        seen.add(a.timed >= a.probe)
        assert window_cost(own, b) <= PLAN_SHARE * 0.01 * (1 + 1e-9)
        for p, plan in ((both, a), (own, b)):
            p.observe(len(plan.windows), {0: 300_000.0, 1: 10_000.0, 2: 4_000.0}, {0: 900, 1: 30, 2: 12})
    assert seen == {True, False}
    own.observe_exposure(0.6)  # one figure: both kinds
    assert own.exposure == own.exposure_timed == 0.6


def test_a_window_second_costs_the_job_at_most_a_second():
    """Probes at 5 probe-seconds a second cannot take more than the window: it is the planned budget
    x interval / 2 long (two windows), not a fifth of that."""
    p = scouted({0: SUB}, {0: STEPPED}, {0: 10_000}, budget=0.01, interval_s=1.0, min_window_s=0.001)
    plan = p.plan()
    assert p.window_cost_per_s(plan.probe, plan.timed) == 1.0
    assert all(w == pytest.approx((PLAN_SHARE * 0.01 - 2 * 2 * WRITE_S) / 2, rel=1e-6) for _, w in plan.windows)


def test_the_cheapest_functions_are_counted_every_call_instead_of_sampled():
    """A function called a few hundred times a second costs next to nothing to count every call,
    and windows of a few ms read it poorly. Such functions stay on the watch link, counted exactly,
    up to KEEP_SHARE of the planned budget (the windows still time them); never a synchronization
    (its time is the wait), never a hot one; one whose rate grows leaves the watch link; a kept one
    is never retired."""
    from gputrace.tracer.budget import KEEP_SHARE

    classes = {0: SUB, 1: QUERY, 2: STATE, 3: SYNC}
    calls = {0: 1000, 1: 2, 2: 1, 3: 1}  # in the 5-ms scout: 200k/s, 400/s, 200/s, 200/s
    p = scouted(classes, {f: CHEAP for f in classes}, calls)
    p.observe_exposure(1.0)
    p.observe(1, {f: n / 0.005 for f, n in calls.items()}, calls)
    assert p.kept == frozenset({1, 2})
    assert sum(p.keep_cost_per_s(f) for f in p.kept) <= KEEP_SHARE * PLAN_SHARE * p.budget
    plan = p.plan()  # still timed in the windows (their counts there are the same calls again)
    assert plan.probe == frozenset(classes) and plan.timed >= {1, 2} and p.watch_set() >= {1, 2}
    for _ in range(p.idle_windows + 1):  # windows in which they were not called: they cost nothing idle
        p.observe(2, {0: 200_000.0, 3: 200.0}, {0: 1000, 3: 1})
    assert not p.retire_idle() & {1, 2} and p.kept == frozenset({1, 2})
    p.observe_kept({1: 5_000.0})  # busier now: counting all of it would cost too much
    p.observe(2, {0: 200_000.0, 3: 200.0}, {0: 1000, 3: 1})
    assert p.kept == frozenset({2}) and 1 not in p.watch_set()
    assert not policy(classes, {f: CHEAP for f in classes}, keep_share=0.0).kept


def test_the_rarer_functions_get_a_longer_window_of_their_own():
    """Beside a function at 200k calls/s, windows are milliseconds long; five functions at 1k/s each
    (under a tenth of the cost together) get one window of their own in the interval's last quarter,
    many times longer (not in the interval that times every function); it counts them without
    timing, the other windows leave them to it but for the wait (timed in every window), and the
    plan still spends the planned budget, no more."""
    from gputrace.tracer.budget import RARE_SLOT

    classes = {0: SUB, 1: QUERY, 2: QUERY, 3: STATE, 4: STATE, 5: SYNC}
    calls = {0: 1000, 1: 5, 2: 5, 3: 5, 4: 5, 5: 5}  # in the 5-ms scout: 200k/s, then 1k/s each
    p = scouted(classes, {f: CHEAP for f in classes}, calls, keep_share=0.0)
    p.observe_exposure(1.0)
    p.observe(1, {f: n / 0.005 for f, n in calls.items()}, calls)
    plan = p.plan()  # the interval that times every function: its windows take the whole budget
    assert plan.timed == frozenset(classes) and plan.rare is None and plan.probe == frozenset(classes)
    plan = p.plan()
    assert plan.rare is not None and plan.rare_set == frozenset({1, 2, 3, 4})
    assert plan.rare_probe == frozenset({1, 2, 3, 4, 5}) and 5 in plan.rare_timed  # the wait too, timed
    assert plan.probe == frozenset({0, 5})  # the wait stays in every window, timed
    assert 5 in plan.timed
    # Timed in the first rare window and every retime_every-th, counted in the others.
    timed = [plan.rare_timed] + [x.rare_timed for x in (p.plan() for _ in range(3 * p.retime_every)) if x.rare]
    assert timed[0] == plan.rare_probe and frozenset({5}) in timed
    # A rarer function no window has timed yet is timed in every rare window until one has.
    p.untimed = frozenset({2})
    timed = [x.rare_timed for x in (p.plan() for _ in range(3 * p.retime_every)) if x.rare]
    assert timed and all(2 in t and 5 in t for t in timed) and frozenset({2, 5}) in timed
    at, length = plan.rare
    assert length > 10 * max(w for _, w in plan.windows)
    assert (1 - RARE_SLOT) * p.interval_s <= at and at + length <= p.interval_s
    assert all(o + w <= (1 - RARE_SLOT) * p.interval_s for o, w in plan.windows)
    assert window_cost(p, plan) == pytest.approx(PLAN_SHARE * p.budget * p.interval_s, rel=1e-6)
    # One function alone is never split off; none at all where nothing but the hot one is called.
    q = scouted({0: SUB, 1: QUERY}, {0: CHEAP, 1: CHEAP}, {0: 1000}, keep_share=0.0)
    assert q.plan().rare is None


def test_a_rare_window_one_interval_cannot_pay_for_comes_every_few_intervals():
    """Where one interval's share buys less than RARE_MIN_S of the rarer functions, their window
    comes at once and then every k-th interval, k times as long (the count of a burst a step is off by its edges: one
    long window beats k short ones), and every interval's windows stay within the planned budget on
    average; the other windows leave the rarer functions to it in the intervals between."""
    from gputrace.tracer.budget import RARE_MAX_EVERY, RARE_MIN_S

    classes = {0: SUB, 1: QUERY, 2: QUERY, 3: STATE, 4: STATE, 5: QUERY}
    calls = {0: 1000, 1: 10, 2: 10, 3: 10, 4: 10, 5: 10}  # 200k/s, then 2k/s each: 5% of the cost
    p = scouted(classes, {f: CHEAP for f in classes}, calls, keep_share=0.0, retime_every=100, budget=0.002)
    p.observe_exposure(1.0)
    p.plan()  # the interval that times every function (it costs the next one's budget: no window)
    plans = [x for x in (p.plan() for _ in range(13)) if x.attach]
    held = [i for i, x in enumerate(plans) if x.rare is not None]
    k = held[1] - held[0]
    assert held[0] == 0  # the first at once: a 5-s attach has three intervals for it
    assert 1 < k <= RARE_MAX_EVERY and all(b - a == k for a, b in zip(held, held[1:]))
    counted = [i for i in held if not plans[i].rare_timed]  # (the timed ones cost twice as much a second)
    assert counted and all(plans[i].rare[1] >= RARE_MIN_S * 0.99 for i in counted)
    # (Their reference may be a rarer function, probed in them for it: a window is read against one.)
    assert all(x.probe - {x.marker} == frozenset({0}) and x.rare_set == frozenset({1, 2, 3, 4, 5}) for x in plans)
    spent = sum(window_cost(p, x) for x in plans[held[0] + 1:held[-1] + 1])
    assert spent == pytest.approx(PLAN_SHARE * p.budget * p.interval_s * (held[-1] - held[0]), rel=0.02)


def test_every_window_is_read_against_a_reference_where_any_probed_function_can_be_one():
    """Where the hot functions are all dear to probe (single-stepped), their windows' reference is a
    cheap function probed elsewhere this interval (the rarer ones', here), probed in them for it;
    and the rarer functions' own window has one too, probed alone for as long just before it, inside
    its slot. Without them both rested on the exposure: a 5-s attach read 0..46k calls/s for 16.7k."""
    from gputrace.tracer.budget import RARE_SLOT

    classes = {0: SUB, 1: QUERY, 2: QUERY, 3: STATE}
    costs = {0: STEPPED, 1: STEPPED, 2: CHEAP, 3: CHEAP}
    # 60k/s each of the stepped ones; 10k/s of the cheap ones: a reference span 1% probes.
    p = scouted(classes, costs, {0: 300, 1: 300, 2: 50, 3: 50}, keep_share=0.0, retime_every=100, budget=0.01)
    p.observe_exposure(1.0)
    plans = [p.plan() for _ in range(6)]
    assert all(x.marker in (2, 3) and x.marker in x.probe for x in plans)
    rare = [x for x in plans if x.rare is not None]
    assert rare and all(x.probe - {x.marker} == {0, 1} for x in rare)
    for x in rare:
        at, w = x.rare
        assert x.rare_marker in (2, 3) and x.rare_marker in x.rare_probe
        span = p.interval_s * (1.0 - RARE_SLOT)
        assert span + w <= at + 1e-9 and at + w <= p.interval_s + 1e-9  # its reference span, then it, in its slot


def test_the_rare_window_gives_way_to_one_window_of_the_hot_functions():
    """Where the rare window's share would leave the hot functions less than one min_window_s window
    (on the H200, GPT-2's getters at 300k calls/s, planned at an exposure of 3), it takes less."""
    from gputrace.tracer.budget import RARE_SHARE

    classes = {i: QUERY for i in range(12)}
    rates = {0: 240e3, 1: 74e3, 2: 15e3} | {i: 2e3 for i in range(3, 12)}
    p = scouted(classes, {f: CHEAP for f in classes}, {f: int(r * 0.005) for f, r in rates.items()},
                keep_share=0.0, retime_every=100, budget=0.005)
    p.observe_exposure(3.0)
    p.plan()
    assert p.affordable_s(frozenset({0, 1}), frozenset(), 1, 1, share=1 - RARE_SHARE) < p.min_window_s
    plan = p.plan()
    assert plan.rare is not None and plan.probe - {plan.marker} == frozenset({0, 1})
    assert min(w for _, w in plan.windows) >= p.min_window_s * 0.999


def test_windows_grow_at_most_max_growth_per_interval():
    """An idle job makes long windows cheap; if it turns busy the next window must not be long already."""
    p = scouted({0: QUERY}, {0: CHEAP}, {0: 1}, max_growth=2.0, scout_s=0.005)
    p.observe(2, {0: 1.0}, {0: 1})  # next to no calls: the budget alone would allow half the interval
    sizes = [p.plan().windows[0][1] for _ in range(5)]
    assert sizes[0] <= 2 * 0.005 + 1e-12
    assert all(b <= 2.0 * a + 1e-12 for a, b in zip(sizes, sizes[1:])) and sizes[-1] > sizes[0]


def test_windows_are_spread_out_when_even_one_costs_more_than_an_interval():
    budget, interval, min_window = 0.006, 0.1, 0.002
    p = scouted({0: SUB}, {0: STEPPED}, {0: 2000}, scout_s=0.001, budget=budget, interval_s=interval,
                min_window_s=min_window)
    plans = [p.plan() for _ in range(12)]
    attached = [i for i, pl in enumerate(plans) if pl.attach]
    assert attached[0] == 0 and len(attached) >= 2
    cycle = attached[1] - attached[0]
    assert cycle > 1 and attached == list(range(0, 12, cycle))
    assert all(len(pl.windows) == 1 and pl.window_s >= min_window for pl in plans if pl.attach)
    assert all(pl.windows == () for pl in plans if not pl.attach)
    # One window every `cycle` intervals costs what `cycle` intervals' budget pays for.
    assert window_cost(p, plans[0]) <= budget * interval * cycle * (1 + 1e-9)


def test_exact_plans_the_full_interval_every_time():
    classes = {0: SUB, 1: SYNC}
    p = policy(classes, {0: STEPPED, 1: STEPPED}, budget=1.0, interval_s=0.5)
    for _ in range(6):
        plan = p.plan()
        assert plan.attach and plan.windows == ((0.0, 0.5),)
        assert plan.timed == frozenset(classes) == plan.probe  # however hot: every call counted and timed
        assert p.watch_set() == frozenset()
        p.observe(1, {0: 1e6, 1: 10.0}, {0: 500_000, 1: 5})


def test_hot_functions_are_timed_only_every_retime_interval():
    classes = {0: SUB, 1: SYNC, 2: STATE}
    p = scouted(classes, {f: CHEAP for f in classes}, {0: 1000, 1: 1000, 2: 10}, scout_s=0.01, budget=0.05,
                retime_every=4, hot_hz=5000)
    timed = []
    for _ in range(8):
        timed.append(p.plan().timed)
        p.observe(2, {0: 1e5, 1: 1e5, 2: 1e3}, {0: 100, 1: 100, 2: 1})
    everything, cold_or_sync = frozenset(classes), frozenset({1, 2})
    assert timed == [everything] + [cold_or_sync] * 3 + [everything] + [cold_or_sync] * 3


def test_an_interval_that_timed_every_function_but_saw_no_hot_call_is_planned_again_once():
    """Only that interval times the hot functions (their per-call times, and with them the driver
    CPU): one whose windows saw none of their calls (a job paused for the few ms of its window) is
    followed by another, once."""
    classes = {0: SUB, 1: SYNC, 2: STATE}
    p = scouted(classes, {f: CHEAP for f in classes}, {0: 1000, 1: 1000, 2: 10}, scout_s=0.01, budget=0.05,
                retime_every=4, hot_hz=5000)
    everything = frozenset(classes)
    assert p.plan().timed == everything
    p.observe(2, {0: 0.0, 1: 0.0, 2: 0.0}, {})  # its windows saw nothing
    assert p.plan().timed == everything  # again
    p.observe(2, {0: 0.0, 1: 0.0, 2: 0.0}, {})  # nothing again: not a third time
    assert p.plan().timed != everything
    p.observe(2, {0: 1e5, 1: 1e5, 2: 1e3}, {0: 100, 1: 100, 2: 1})
    timed = [p.plan().timed for _ in range(4)]
    assert timed.count(everything) == 1


def test_a_function_not_called_for_idle_windows_goes_back_to_the_watch_link():
    # (No step windows: the step function would be kept, counted on the watch link, never idle.)
    p = scouted({0: SUB, 1: QUERY}, {0: CHEAP, 1: CHEAP}, {0: 100, 1: 10}, idle_windows=4, step_windows=False)
    for _ in range(2):
        p.observe(2, {0: 2e4, 1: 0.0}, {0: 100})  # function 1 probed, no longer called
    p.observe(2, {0: 2e4}, {0: 100})  # not probed (left to a rare window): not idle for that
    assert p.idle[1] == 4
    assert p.retire_idle() == frozenset({1})
    assert p.probe_set() == frozenset({0}) and p.watch_set() == frozenset({1}) and 1 not in p.rates


# --- budget.AlignedPolicy (host-wide windows) -----------------------------------------------------------------------

def aligned(members: dict[int, float], scout_s: float = 0.005):
    """An AlignedPolicy over one SUB function, members pid -> calls/s, each past its scout window."""
    from gputrace.tracer.budget import AlignedPolicy

    host = AlignedPolicy({0: SUB}, {0: CHEAP}, budget=0.01, interval_s=1.0, max_growth=None, rng=random.Random(7))
    for pid, rate in members.items():
        host.members[pid] = scouted({0: SUB}, {0: CHEAP}, {0: int(rate * scout_s)}, scout_s=scout_s)
    host.plan()  # the host's own scout
    host.merge(1)
    return host


def test_aligned_windows_are_the_least_any_member_affords():
    host = aligned({1: 10_000.0, 2: 1_000.0, 3: 50_000.0})
    plan = host.plan()
    for pid, p in host.members.items():  # no member's expected cost exceeds its budget
        assert window_cost(p, plan) <= PLAN_SHARE * 0.01 * (1 + 1e-9), pid
    assert window_cost(host.members[3], plan) == pytest.approx(PLAN_SHARE * 0.01, rel=1e-6)  # the busiest decides


def test_a_burst_of_unplanned_cost_takes_one_intervals_windows_not_many():
    """A job's set-up calls its functions for the first time by the thousand (cost on the watch link
    that no plan saw, 40 ms of a 10-ms budget): the windows give up at most one interval for it. Paid
    for in full, an H100 job went 13 s without a window while it switched to CUDA-graph replay."""
    p = scouted({0: SUB, 1: QUERY}, {0: CHEAP, 1: CHEAP}, {0: 100, 1: 20}, budget=0.01, interval_s=1.0,
                step_windows=False)
    assert p.plan().windows
    p.observe_extra(0.040)
    planned = []
    for _ in range(4):
        plan = p.plan()
        planned.append(bool(plan.windows))
        p.observe(len(plan.windows), dict(p.rates), {0: 10, 1: 2} if plan.windows else {})
        p.observe_extra(0.0)
    assert planned.count(False) <= 1, planned


def test_a_function_the_scout_caught_once_or_twice_is_no_reference():
    """A set-up call the scout caught twice in its 5 ms reads 400 calls/s, cheap enough to be a
    reference; but no more of it come, and a window read against a marker that made no call in it
    stands on nothing (simcuda here: a 1-s job's only window after the scout had cuModuleGetFunction
    as its marker, 0 calls in and out)."""
    p = scouted({0: SUB, 1: QUERY, 2: QUERY}, {f: CHEAP for f in range(3)}, {0: 100, 1: 2, 2: 1}, budget=0.05,
                interval_s=1.0, scout_s=0.0002)
    # The next interval's windows saw function 2 again, not 1 (whose rate stands as the scout read it).
    p.observe(2, {0: 500_000.0, 2: 5_000.0}, {0: 400, 2: 12})
    assert p.rates[1] > p.rates[2] and p.ref_share(1) <= 0.02 and not p.repeats(1)
    assert p.ref_share(2) <= 0.02 and p.repeats(2)
    assert p.choose_marker(frozenset({0, 1, 2}), frozenset()) == 2  # fewer calls a second, but they repeat


def test_a_member_that_joins_holds_the_windows_to_its_scout_until_measured():
    host = aligned({1: 1_000.0})
    from gputrace.tracer.budget import WRITE_S, Policy as P

    host.members[2] = P({0: SUB}, {0: CHEAP}, budget=0.01, interval_s=1.0)
    plan = host.plan()
    assert not plan.full_scan  # the watch link covers what it calls that no one else does
    assert sum(w for _, w in plan.windows) == pytest.approx(host.members[2].scout_s())


def test_the_shared_marker_fits_every_members_budget():
    host = aligned({1: 80_000.0, 2: 500.0})
    probe = frozenset({0})
    # Too busy in member 1 to be a reference there (8% of its span at 1 us a hit), and all member 2
    # calls: as the exposure's marker its reference would cost member 2 as much as its window.
    assert host.choose_marker(probe, frozenset()) is None
    # Cheap enough for every member: a reference, whatever the window costs.
    assert aligned({1: 10_000.0, 2: 500.0}).choose_marker(probe, frozenset()) == 0


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
    added = rate * preset.cost_ns * 1e-9
    assert a.added_cpu_s_per_s == pytest.approx(added)
    # Exposed, the layer also slows the caller's own code (INDIRECT_MAX); hidden, only its own time can hide.
    assert a.slowdown_upper == pytest.approx(added * INDIRECT_MAX) and a.indirect_max == INDIRECT_MAX > 1
    assert a.slowdown_lower == pytest.approx(max(0.0, added - wait))
    assert 0.0 <= a.slowdown_lower <= a.slowdown_upper
    assert a.wait_s_per_s == wait and a.cost_ns == preset.cost_ns
    assert set(a.classes) == {c.value for c in preset.classes}
    assert a.tracer_overhead == pytest.approx(0.002 / 1.0)  # of the job's time: what it can have slowed it


@pytest.mark.parametrize("rel", [0.0, 0.2, 1.5])
def test_audit_range_with_the_rates_intervals_covers_the_bounds_at_either_end_of_them(rel):
    """The point bounds use the rates as read; the range puts the intercepted rate at either end of its
    95% interval (the functions' half-widths added), so that a rate read high or low within what it
    states still leaves the truth inside."""
    wait = 0.004
    snap = dataclasses.replace(snapshot(wait), functions=tuple(
        dataclasses.replace(f, rate_err_hz=rel * f.rate_hz) for f in snapshot(wait).functions))
    preset = make_preset("shim", 1000.0)
    a = audit(snap, preset)
    rate = sum(r for c, r in RATES.values() if c in preset.classes)
    assert a.intercepted_err_hz == pytest.approx(rel * rate)
    c = preset.cost_ns * 1e-9
    assert a.slowdown_lower_min == pytest.approx(max(0.0, max(0.0, rate * (1 - rel)) * c - wait))
    assert a.slowdown_upper_max == pytest.approx(rate * (1 + rel) * c * INDIRECT_MAX)
    assert a.slowdown_lower_min <= a.slowdown_lower <= a.slowdown_upper <= a.slowdown_upper_max
    if rel == 0.0:  # counted throughout (--exact): the range is the bounds
        assert (a.slowdown_lower_min, a.slowdown_upper_max) == pytest.approx((a.slowdown_lower, a.slowdown_upper))
    if rel > 0.5:  # the rate is not known: its bounds are the range's, and no point is given
        assert a.not_known and (a.slowdown_lower, a.slowdown_upper) == (a.slowdown_lower_min, a.slowdown_upper_max)
    else:
        assert a.not_known is None and a.slowdown_upper == pytest.approx(rate * c * INDIRECT_MAX)
    # Any rate with its interval not known: the range is not known (never the point bounds in its place).
    unknown = dataclasses.replace(snap, functions=tuple(
        dataclasses.replace(f, rate_err_hz=None) if f.name == "cuMemAlloc_v2" else f for f in snap.functions))
    b = audit(unknown, preset)
    assert b.intercepted_err_hz is None and b.slowdown_lower_min is None and b.slowdown_upper_max is None
    assert b.slowdown_upper == pytest.approx(rate * c * INDIRECT_MAX) and b.not_known is None


def test_audit_presets_and_overrides():
    assert PRESETS["shim"].classes == frozenset({SUB, STATE})
    assert PRESETS["proxy"].classes == frozenset(CLASS_ORDER)
    assert make_preset("shim") is PRESETS["shim"]
    given = make_preset("shim", 250.0)
    assert given.cost_ns == 250.0 and given.cost_source == "given with --cost-ns"
    assert given.classes == PRESETS["shim"].classes
    assert audit(snapshot(0.0, target_cpu_s=None), given).tracer_overhead == pytest.approx(0.002)
    assert snapshot(0.0, target_cpu_s=None).tracer_cpu_share is None  # not measured, not zero


def test_audit_lower_bound_needs_the_wait_even_with_nothing_intercepted():
    """No wait timed: the lower bound is not known, even where the intercepted rate reads 0 (with
    --functions the layer's functions may not have been traced at all). A job takes its lower bound
    from the ranks that have one (hostview/model.py: job_of)."""
    s = dataclasses.replace(snapshot(0.1), functions=(), driver_cpu_s_per_s=None, wait_s_per_s=None)
    a = audit(s, PRESETS["shim"])
    assert a.not_measured is None and a.intercepted_hz == 0 and a.slowdown_upper == 0
    assert a.slowdown_lower is None and a.slowdown_lower_min is None


def test_audit_of_a_process_not_measured_has_no_figures():
    s = dataclasses.replace(snapshot(0.1), functions=(), driver_cpu_s_per_s=None, wait_s_per_s=None,
                            not_measured="no window in this interval")
    a = audit(s, PRESETS["proxy"])
    assert a.not_measured == "no window in this interval"
    assert None is a.calls_hz is a.intercepted_hz is a.slowdown_lower is a.slowdown_upper is a.added_cpu_s_per_s
    assert s.calls_hz is None  # not 0 calls/s


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
    assert "  traced             10.0 s; probes attached 5.0% of it (sampled windows, budget 1.0% of its time)" in lines
    assert any(ln.startswith("  probe cost         1.20 µs a counted call, 2.50 µs a timed call")
               and ln.endswith("(emulated first instruction)") for ln in lines)
    assert any(ln.startswith("  probe cost         5.60 µs") and ln.endswith("(stepped first instruction)")
               for ln in lines)
    assert any(ln.startswith("  tracer's own cost  0.16% of the job's time: 16.00 ms, 0.20% of its 8.00 CPU-s")
               for ln in lines)
    assert "  command exited     with status 0" in lines
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.startswith("  cu")}
    assert rows["cuCtxGetDevice_v2"][1:3] == ["query", "90.0k"]
    assert rows["cuModuleLoadData"][-2:] == ["-", "-"]  # never timed: no mean, no p99
    for a in r.audits:
        what = (f"the {a.preset_functions} functions the shim gates ({', '.join(a.classes)})"
                if a.preset_functions is not None else ', '.join(a.classes))
        assert f"  - {a.preset}: intercepts {what} at {fmt_ns(a.cost_ns)} a call" in text
        assert (f"predicted slowdown between {fmt_pct(a.slowdown_lower)} (hidden in the wait) "
                f"and {fmt_pct(a.slowdown_upper)} (fully exposed)") in text
    # Unpaired returns and stale frames come with every window edge; only real trouble is noted.
    assert "  tracer notes: depth 3" in lines


def test_text_report_shows_the_range_the_rates_intervals_give():
    r = make_report()
    funcs = tuple(dataclasses.replace(f, rate_err_hz=0.25 * f.rate_hz) for f in r.summary.functions)
    summary = dataclasses.replace(r.summary, functions=funcs)
    r = dataclasses.replace(r, summary=summary, audits=tuple(audit(summary, p) for p in PRESETS.values()))
    text = render(r)
    for a in r.audits:
        assert (f"with the rates' 95% intervals (±{fmt_rate(a.intercepted_err_hz)} calls/s): "
                f"{fmt_pct(a.slowdown_lower_min)} to {fmt_pct(a.slowdown_upper_max)}") in text
    doc = json.loads(render(r, "json"))
    assert [x["slowdown_upper_max"] for x in doc["audits"]] == pytest.approx([a.slowdown_upper_max for a in r.audits])
    assert "95% intervals" not in render(make_report())  # counted throughout: the bounds are the range


def test_text_report_exact_and_clean():
    text = render(make_report(exact=True))
    assert "probes attached 100.0% of it (every call (exact))" in text
    assert "tracer notes" not in text


def test_a_share_of_the_interval_is_never_shown_above_all_of_it():
    r = make_report(exact=True)
    s = dataclasses.replace(r.summary, window_s=r.summary.interval_s * 1.001)  # stamped a little apart
    assert "probes attached 100.0% of it" in render(dataclasses.replace(r, summary=s))
    iv = dataclasses.replace(r.intervals[1], window_s=r.intervals[1].interval_s * 1.001)
    out = io.StringIO()
    rep.get("text").interval(iv, out)
    assert "probed 100.0% of the interval" in out.getvalue()


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
    assert f"{fmt_rate(r.intervals[1].processes[0].calls_hz)} calls/s" in line
    assert "probed 50.0% of the interval" in line and "tracer 0.16% of its time" in line


def test_a_time_in_calls_above_100_percent_says_why_where_it_is_shown():
    """Two threads each waiting most of a second read wait 180%: the interval line and the final
    report say it is summed over threads; the TUI's cell is marked Σ (its help says what that is)."""
    from gputrace.tui.text import COLUMNS, fmt_thread_share

    r = make_report()
    busy = dataclasses.replace(r.intervals[1].processes[0], wait_s_per_s=1.8)
    out = io.StringIO()
    rep.get("text").interval(dataclasses.replace(r.intervals[1], processes=(busy,)), out)
    assert "wait 180.0% (summed over threads)" in out.getvalue()
    out = io.StringIO()
    rep.get("text").interval(r.intervals[1], out)
    assert "summed over threads" not in out.getvalue()
    text = render(dataclasses.replace(r, summary=dataclasses.replace(r.summary, wait_s_per_s=1.8)))
    assert "(above 100%: summed over the threads that make driver calls)" in text
    assert "(above 100%" not in render(r)
    assert [fmt_thread_share(x) for x in (None, 0.5, 1.0, 1.163)] == ["-", "50.0%", "100.0%", "116.3%Σ"]
    from types import SimpleNamespace
    row = SimpleNamespace(snapshot=SimpleNamespace(wait_s_per_s=1.163, driver_cpu_s_per_s=0.2))
    assert COLUMNS["wait"][1](row, "shim", 0.0) == "116.3%Σ" and COLUMNS["cpu"][1](row, "shim", 0.0) == "20.0%"


def test_text_reports_say_not_measured_rather_than_zero():
    r = make_report()
    blank = dataclasses.replace(r.intervals[1].processes[0], functions=(), driver_cpu_s_per_s=None,
                                wait_s_per_s=None, not_measured="no window in this interval")
    out = io.StringIO()
    rep.get("text").interval(dataclasses.replace(r.intervals[1], processes=(blank,)), out)
    assert out.getvalue() == "[    1.0s] pid 4242 train: not measured (no window in this interval)\n"
    summary = dataclasses.replace(r.summary, functions=(), driver_cpu_s_per_s=None, wait_s_per_s=None,
                                  not_measured="not measured yet: no window has probed this process")
    text = render(dataclasses.replace(r, summary=summary, audits=tuple(audit(summary, p) for p in PRESETS.values())))
    assert "  not measured: not measured yet: no window has probed this process" in text
    assert "calls/s" not in text and "0.0" not in text.split("not measured:")[1]


def test_json_report_parses_with_its_schema():
    r = make_report(errors={"depth": 1})
    doc = orjson.loads(render(r, "json"))
    assert doc["schema"] == rep.SCHEMA
    assert set(doc) == {"schema", "kind", "pid", "comm", "library", "command", "exit_status", "options",
                        "calibration", "attach", "summary", "audits", "errors", "intervals"}
    assert doc["kind"] == "gputrace.attach" and doc["command"] == ["python", "train.py"]
    s = doc["summary"]
    assert s["calls_hz"] == pytest.approx(r.summary.calls_hz)
    assert s["tracer_overhead"] == pytest.approx(0.016 / 10.0)
    funcs = {f["name"]: f for f in s["functions"]}
    assert funcs["cuLaunchKernel"]["cls"] == "submission"
    assert funcs["cuModuleLoadData"]["mean_ns"] is None  # not measured: null, not 0
    assert [a["preset"] for a in doc["audits"]] == list(PRESETS)
    assert doc["errors"]["depth"] == 1
    assert len(doc["intervals"]) == 2 and doc["intervals"][1]["processes"][0]["pid"] == 4242
    assert doc["calibration"]["stepped"]["entry_ns"] == 5600.0
    assert rep.report_dict(r, with_intervals=False)["intervals"] == []


def test_renderers_come_from_the_registry():
    assert set(rep.RENDERERS) >= {("attach", "text"), ("attach", "json"), ("frame", "text"), ("frame", "json")}
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


def test_header_constants_are_evaluated_not_guessed():
    text = """#define GT_A 40          /* forty */
#define GT_B (1ULL << 35) /* a cookie bit */
#define GT_C 0xffffffffULL
#define GT_D some_macro(x)
enum gt_error {
    GT_ERR_X = 0,  /* first */
    GT_ERR_Y,
    GT_ERR_COUNT,
};"""
    c = bpfprog.header_constants(text)
    assert c == {"GT_A": 40, "GT_B": 1 << 35, "GT_C": 0xFFFFFFFF, "GT_ERR_X": 0, "GT_ERR_Y": 1, "GT_ERR_COUNT": 2}


def test_map_layout_is_read_from_the_ctypes_type_field_by_field():
    import ctypes

    class Leaf(ctypes.Structure):  # the shape bcc builds for struct gt_stats
        _fields_ = [("calls", ctypes.c_ulonglong), ("timed", ctypes.c_ulonglong), ("hist", ctypes.c_ulonglong * 4),
                    ("outside", ctypes.c_ulonglong)]

    lay = bpfprog.Layout.of(Leaf)
    row = Leaf(5, 2, (ctypes.c_ulonglong * 4)(1, 2, 3, 4), 9)
    v = lay.struct.unpack(bytes(row))
    assert v[lay.index("calls")] == 5 and v[lay.fields["hist"]] == (1, 2, 3, 4) and v[lay.index("outside")] == 9

    class Padded(ctypes.Structure):
        _fields_ = [("a", ctypes.c_uint32), ("b", ctypes.c_uint64)]

    class Floating(ctypes.Structure):
        _fields_ = [("a", ctypes.c_double)]

    for bad in (Padded, Floating):
        with pytest.raises(bpfprog.BpfUnavailable, match="layout"):
            bpfprog.Layout.of(bad)


def test_rawstats_arithmetic():
    a = bpfprog.RawStats(10, 8, 800, 600, 2, 1, hist(s3=5, s9=3))
    b = bpfprog.RawStats(4, 3, 300, 200, 1, 0, hist(s3=2, s9=1))
    assert a - b == bpfprog.RawStats(6, 5, 500, 400, 1, 1, hist(s3=3, s9=2))
    assert (a - b) + b == a
    assert a - bpfprog.ZERO == a
    assert math.isclose(sum((a - b).hist), (a - b).timed)


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


def test_a_live_view_keeps_memory_bounded():
    """top runs for days: a process traced for the recent view alone keeps no growing history."""
    import os
    import types

    from gputrace.tracer.bpfprog import ZERO, RawStats
    from gputrace.tracer.probes import IntervalLog, WindowSpan
    from gputrace.tracer.symbols import Function
    from gputrace.tracer.tracee import RECENT, Tracee

    cost = ProbeCost(entry_ns=500.0, entry_return_ns=900.0, bias_ns=300.0)
    fn = Function("cuLaunchKernel", 0x1000, 0x1000, 16, SUB)
    probes = types.SimpleNamespace(ids={0: fn}, classes={0: SUB}, costs={0: cost}, kinds={0: "emulated"}, irregular=set(),
                                   calibration=Calibration(cost, cost, 5.0, 1, 1))
    for keep, bound in ((False, 1), (True, 200)):
        t = Tracee(os.getpid(), probes, budget=0.01, interval_s=1.0, exact=False, keep=keep)
        rows = ZERO
        for k in range(200):
            t.begin()
            rows = rows + RawStats(100, 0, 0, 0, 0, 0, ZERO.hist)
            log = IntervalLog([WindowSpan(0.01, frozenset({0}), frozenset())], {0: 1.0})
            t.account(1.0, log, [{0: rows}], {0: rows}, snapshot=False)
        assert len(t.observations) == bound and len(t._recent) == RECENT
        assert t.recent().calls_hz == pytest.approx(10_000, rel=0.1)


def _one_function_tracee(pid: int):
    import types

    from gputrace.tracer.symbols import Function
    from gputrace.tracer.tracee import Tracee

    cost = ProbeCost(entry_ns=500.0, entry_return_ns=900.0, bias_ns=300.0)
    fn = Function("cuLaunchKernel", 0x1000, 0x1000, 16, SUB)
    probes = types.SimpleNamespace(ids={0: fn}, classes={0: SUB}, costs={0: cost}, kinds={0: "emulated"}, irregular=set(),
                                   calibration=Calibration(cost, cost, 5.0, 1, 1))
    return Tracee(pid, probes, budget=0.01, interval_s=1.0, exact=False)


@pytest.mark.parametrize("window_s, expect_measured", [(0.0001, False), (0.05, True)])
def test_no_call_in_a_tiny_window_is_not_measured_rather_than_zero(window_s, expect_measured):
    """A process that exits 0.1 ms after the probes are on shows no call; 0 calls/s would be a guess
    (the H200 showed it for a 2-second job attached as it ended). A longer window with none is 0."""
    import os

    from gputrace.tracer.bpfprog import ZERO
    from gputrace.tracer.probes import IntervalLog, WindowSpan

    t = _one_function_tracee(os.getpid())
    t.begin()
    log = IntervalLog([WindowSpan(window_s, frozenset({0}), frozenset())], {0: 1.0})
    snap = t.account(1.0, log, [{0: ZERO}], {0: ZERO}, snapshot=True)
    if expect_measured:
        assert snap.not_measured is None and snap.calls_hz == 0
    else:
        assert snap.not_measured is not None and "too short to tell" in snap.not_measured


def test_a_functions_filter_says_what_it_changes_in_the_audit():
    """--functions 'cuLaunch*' drops the synchronizations (wait reads not measured) and a narrower
    filter drops some of them: each is said, with the calls left out."""
    from types import SimpleNamespace

    from gputrace.commands.attach import filter_warnings

    every = [SimpleNamespace(name=n) for n in ("cuLaunchKernel", "cuStreamSynchronize", "cuEventSynchronize",
                                                 "cuMemcpyDtoH_v2", "cuCtxGetDevice")]
    launches = filter_warnings(every, every[:1])
    assert launches[0].startswith("--functions traces 1 of libcuda's 5 functions")
    assert "leaves out every call that waits" in launches[1]
    some = filter_warnings(every, every[:2])
    assert len(some) == 2 and "(cuEventSynchronize, cuMemcpyDtoH)" in some[1] and "counts only those" in some[1]
    assert len(filter_warnings(every, every)) == 1


def test_every_command_that_takes_a_budget_echoes_a_bare_fraction(capsys):
    """attach, demo, top, record and export share parse_budget: 0.5 is 50%, said on stderr once."""
    assert parse_budget("0.5") == 0.5
    assert capsys.readouterr().err == "gputrace: --budget 0.5 read as 50% of the job's time\n"
    assert parse_budget("1%") == pytest.approx(0.01) and capsys.readouterr().err == ""
    assert parse_budget("0.5", echo=False) == 0.5 and capsys.readouterr().err == ""


# --- step windows ----------------------------------------------------------------------------------------------------

def test_the_step_function_is_kept_beyond_the_kept_share_and_the_windows_are_whole_steps_with_a_marker():
    """A job whose once-a-step function costs more to count than the kept share allows (but within
    STEP_KEEP_SHARE) keeps it anyway: it is the step. Windows then come as whole steps of it
    (period 1 / its rate, stretched by the window's cost), armed on it, each no longer than what the
    budget pays for, with the marker the budget paid for: a step window read by its steps needs none,
    but one that cannot be whole steps when due runs as a window of time, and is read against it;
    without step windows the same job gets windows of time with one."""
    from gputrace.tracer.budget import PLAN_SHARE, STEP_KEEP_SHARE

    classes = {0: SUB, 1: QUERY, 2: STATE}
    costs = {f: CHEAP for f in classes}
    budget = 0.05
    # Function 2 at 250 calls/s: 250 x 1 us x 3 (the exposure's most) = 0.075% of the job's time,
    # above the kept share (1% here) of the planned budget and within the step's.
    assert 0.01 * PLAN_SHARE * budget < 250 * 1e-6 * 3 <= STEP_KEEP_SHARE * PLAN_SHARE * budget
    calls = {0: 300, 1: 60, 2: 1}  # in 4 ms: 75k/s, 15k/s, 250/s
    p = scouted(classes, costs, calls, scout_s=0.004, budget=budget, interval_s=1.0, rare_share=0.0, keep_share=0.01)
    assert p.kept == frozenset({2})
    p.plan()  # the interval that times every function
    p.observe(2, {0: 75e3, 1: 15e3}, {0: 300, 1: 60})
    p.observe_kept({2: 250.0})
    plan = p.plan()
    assert plan.step == 2 and plan.step_hz == 250.0 and plan.marker is not None
    assert plan.marker == p.choose_marker(plan.probe, plan.timed, plan.probe)
    f, period = p.step_of(p.window_cost_per_s(plan.probe, plan.timed))
    assert f == 2 and period > 1 / 250.0
    afford = p.affordable_s(plan.probe, plan.timed, p.choose_marker(plan.probe, plan.timed), len(plan.windows))
    for _, w in plan.windows:
        steps = w / period
        assert abs(steps - round(steps)) < 1e-6 and round(steps) >= 1 and w <= afford + 1e-9
    q = scouted(classes, costs, calls, scout_s=0.004, budget=budget, interval_s=1.0, rare_share=0.0, keep_share=0.01,
                step_windows=False)
    assert q.kept == frozenset()
    q.plan()
    q.observe(2, {0: 75e3, 1: 15e3, 2: 250.0}, {0: 300, 1: 60, 2: 1})
    plain = q.plan()
    assert plain.step is None and plain.marker is not None


def test_a_gpt2_step_at_the_rates_of_an_attach_that_read_them_high_still_gets_a_whole_step_window():
    """One 5-s attach to GPT-2 on the H200 (audit round 11, run 24, its third): rates read 1.4x high
    (15 functions, 0.9M calls/s at 529 ns a probe, exposure 1.5), an 80/s loss copy kept as the step.
    The step stretched as 1 / (1 - cost) planned its 12.5-ms step at 40 ms, which five intervals'
    budget did not pay for: no whole-step window in the attach, and its hottest rates stayed +36..+64%.
    As 1 + cost (what the job's steps took in such windows: 17.5-26 ms) it is planned within the
    first two intervals after the one that times every function."""
    from gputrace.tracer.calibrate import ProbeCost as PC

    h200 = PC(entry_ns=529.0, entry_return_ns=984.0, bias_ns=376.0)
    rates = {0: 582743.0, 1: 182678.0, 2: 46111.0, 3: 10473.0, 4: 8043.0, 5: 7708.0, 6: 4440.0, 7: 3184.0,
             8: 2178.0, 9: 2178.0, 10: 2011.0, 11: 1676.0, 12: 508.0, 13: 80.0}
    classes = {f: (SUB if f in (2, 5) else STATE if f == 1 else QUERY) for f in rates}
    p = scouted(classes, {f: h200 for f in classes}, {f: max(1, int(r * 0.003)) for f, r in rates.items()},
                scout_s=0.003, budget=0.01, interval_s=1.0)
    p.irregular = {12}  # (six calls close together a step: not the step)
    planned = []
    for _ in range(4):
        p.observe_kept({12: 508.0, 13: 80.0})
        p.observe_exposure(1.5, 1.31)
        plan = p.plan()
        planned.append(plan)
        p.observe(len(plan.windows), {f: r for f, r in rates.items() if f in plan.probe and f not in p.kept},
                  {f: 10 for f in plan.probe})
    assert p.kept >= {13}
    whole = [pl for pl in planned[1:3] if pl.step == 13 and len(pl.probe) >= 12]
    assert whole, [(pl.windows, pl.step, len(pl.probe)) for pl in planned]
    (_, w), = whole[0].windows
    assert w == pytest.approx(whole[0].period_s) and 1 / 80.0 < w < 2.0 / 80.0


def test_a_step_once_measured_sets_the_period_not_the_stretch_at_the_exposures_far_end():
    p = scouted({0: SUB, 1: QUERY}, {0: CHEAP, 1: CHEAP}, {0: 300, 1: 1}, scout_s=0.004, budget=0.05, keep_share=0.01)
    p.observe_kept({1: 250.0})
    # Stretched by the probes' time a step: 0.9 s a second of the job untraced, 1.9x its own.
    assert p.step_of(0.9)[1] == pytest.approx(1.9 / 250.0)
    assert p.step_of(2.0)[1] == pytest.approx(3.0 / 250.0)  # (no pole at a cost of one second a second)
    p.observe_step(1, 0.005)
    assert p.step_of(0.9) == (1, pytest.approx(0.005))
    p.observe_step(1, 0.001)  # never shorter than the step untraced
    assert p.step_of(0.9)[1] == pytest.approx(max(0.003, 1 / 250.0))


def test_the_mlps_once_a_step_copy_is_kept_at_the_dearest_calibration_seen_on_the_h200():
    """Audit round 13 on the H200, run 28, the MLP's first 5-s attach: the copy once a step at 856 calls/s, a
    calibrated 701 ns a probe, the exposure not measured yet (planned at its most): 1.8 ms of the
    job a second to count every call, over a quarter of the planned 1% and kept nowhere in the
    attach, which had no step window and four of eight rates outside +-10%. Within STEP_KEEP_SHARE."""
    from gputrace.tracer.budget import STEP_KEEP_SHARE
    from gputrace.tracer.estimator import EXPOSURE_MAX

    classes = {0: QUERY, 1: SUB, 2: STATE, 3: SYNC}
    costs = {f: ProbeCost(entry_ns=701.0, entry_return_ns=1199.0, bias_ns=472.0) for f in classes}
    rate = {0: 240e3, 1: 15e3, 2: 856.0, 3: 856.0}
    assert 0.25 * PLAN_SHARE * 0.01 < EXPOSURE_MAX * 856 * 701e-9 <= STEP_KEEP_SHARE * PLAN_SHARE * 0.01
    p = scouted(classes, costs, {f: round(r * 0.0032) for f, r in rate.items()}, scout_s=0.0032)
    assert p.exposure == EXPOSURE_MAX
    assert p.kept == frozenset({2})  # (3 synchronizes: timed in every window, never kept)
    assert p.step_of(0.0) is None  # not yet counted on the watch link: 3 calls in the scout are no step
    p.observe_kept({2: 856.0})  # an interval of it counted there
    assert p.step_of(0.0)[0] == 2


def test_a_kept_function_that_stops_being_called_is_no_step():
    """A burst of set-up calls (24 in a 20-ms discovery span: 1.2k calls/s) made a function kept and
    the job's step; its rate must fall to 0 once an interval's watch link counts none of it."""
    p = scouted({0: SUB, 1: QUERY}, {0: CHEAP, 1: CHEAP}, {0: 100, 1: 6}, budget=0.01, interval_s=1.0)
    p.kept = frozenset({1})
    p.observe_kept({1: 1200.0})  # the burst, as the watch link counted it
    assert p.step_of(0.0)[0] == 1
    p.observe_kept({1: 0.0})  # (the tracee reports every kept function, those with no call too)
    assert p.step_of(0.0) is None


def test_a_gpt2_step_priced_at_the_unmeasured_exposure_still_gets_a_whole_step_window():
    """Audit round 14 on the H200, run 32, GPT-2's fourth 5-s attach: 15 functions at its final rates, 718 ns a
    probe, the once-a-step loss copy kept, the exposure not measured (planned at its most). A
    whole-step window of every function is priced at about 35 ms of window costing all of it, which
    five intervals' budget did not pay for: the attach had none, and its rates came from 3-ms windows
    of time. WHOLE_STEP_MAX_EVERY intervals pay for it, in the first interval after the one that
    times every function."""
    from gputrace.tracer.budget import WHOLE_STEP_MAX_EVERY
    from gputrace.tracer.calibrate import ProbeCost as PC
    from gputrace.tracer.estimator import EXPOSURE_MAX

    h200 = PC(entry_ns=718.5, entry_return_ns=1249.9, bias_ns=470.2)
    rates = [370116, 112750, 37032, 8076, 6211, 5944, 3424, 2483, 1682, 1682, 1553, 1307, 359, 65, 63]
    cls = [QUERY, QUERY, SUB, QUERY, QUERY, SUB, QUERY, QUERY, QUERY, QUERY, SUB, QUERY, STATE, SYNC, SUB]
    step = 14
    p = scouted(dict(enumerate(cls)), {f: h200 for f in range(15)}, {f: max(1, int(r * 0.003)) for f, r in enumerate(rates)},
                scout_s=0.003, budget=0.01, interval_s=1.0)
    planned = []
    for _ in range(3):
        p.observe_kept({step: 63.0})
        p.observe_exposure(None)
        assert p.exposure == EXPOSURE_MAX
        plan = p.plan()
        planned.append(plan)
        p.observe(len(plan.windows), {f: r for f, r in enumerate(rates) if f in plan.probe and f not in p.kept},
                  {f: 10 for f in plan.probe})
    assert step in p.kept
    whole = planned[1]
    assert whole.step == step and len(whole.probe) == 15, [(pl.windows, pl.step, len(pl.probe)) for pl in planned]
    (_, w), = whole.windows
    assert w == pytest.approx(whole.period_s) and 1 / 63.0 < w
    # Paid for by more intervals than five: the ones after it plan only the waits.
    assert 5 < p.skip + p.every <= WHOLE_STEP_MAX_EVERY


def test_a_function_leaving_the_watch_link_is_off_it_from_when_the_new_links_are_on(monkeypatch):
    """Closing a link waits out a grace period (50 ms on this host, 94 ms on the H200) with its
    breakpoints gone from the start: a function leaving the watch link is off it, and counted nowhere
    on it, through the close. Tallied from after the close, that time stood as counted on the link
    with no calls in it (a function moved off in the scout's interval read 12 calls over 92 ms there
    where the job made 589 a second; in a step window's estimate every rate read 1.2% low, outside
    its stated 0.9%)."""
    import time

    from gputrace import simcuda
    from gputrace.tracer import probes as pr
    from gputrace.tracer.symbols import read_functions

    class Prog:
        def set_hit_costs(self, *a) -> None:
            pass

        def seen_hits(self) -> int:
            return 0

        def kept_hits(self) -> int:
            return 0

    class SlowClose:
        fds = [1]

        def close(self) -> None:
            time.sleep(0.05)

    lib = str(simcuda.library_path())
    functions = tuple(read_functions(lib))[:40]
    p = pr.Probes(lib, functions, Prog(), CALIBRATION)
    monkeypatch.setattr(p, "_attach", lambda ids, cookies, retprobe: SlowClose())
    every = frozenset(p.ids)
    p.set_watch(every)
    p.take_log()
    t0 = time.monotonic()
    p.set_watch(every - {0})  # rebuilds function 0's shard: the old one takes 50 ms to close
    closed = time.monotonic() - t0
    log = p.take_log()
    assert closed >= 0.05
    assert log.unwatched_s[0] >= closed - 0.005, (log.unwatched_s[0], closed)
    assert all(log.unwatched_s.get(f, 0.0) == 0.0 for f in every - {0})  # the others stayed on it


def test_calls_made_while_the_watch_link_is_rebuilt_are_found_by_the_next_poll_as_made_since_it_began(monkeypatch):
    """The caller counts a watched function's new calls from rows it read just before set_watch;
    the poll's mark must be from then too. Taken after the rebuild (which attaches links: ms), it
    hid the calls made meanwhile, and the next poll divided them by one poll period: a native job's
    51,014 calls read as made in 20 ms, its rate 2.5M/s for 150k/s."""
    import time

    from gputrace import simcuda
    from gputrace.tracer import probes as pr
    from gputrace.tracer.symbols import read_functions

    hits = [0]

    class Prog:
        def set_hit_costs(self, *a) -> None:
            pass

        def seen_hits(self) -> int:
            return hits[0]

        def kept_hits(self) -> int:
            return 0

    class Link:
        fds = [1]

        def close(self) -> None:
            pass

    def attach(ids, cookies, retprobe):
        hits[0] += 3  # the job calls on while the links change
        time.sleep(0.01)
        return Link()

    lib = str(simcuda.library_path())
    functions = tuple(read_functions(lib))[:40]
    p = pr.Probes(lib, functions, Prog(), CALIBRATION)
    monkeypatch.setattr(p, "_attach", attach)
    every = frozenset(p.ids)
    p.set_watch(every)
    assert p.poll_seen() is not None  # the first build's own hits
    assert p.poll_seen() is None
    t0 = time.monotonic()
    p.set_watch(every - {0})
    since = p.poll_seen()
    assert since is not None and since >= time.monotonic() - t0 - 0.002, since
    assert p.poll_seen() is None


def test_a_whole_step_window_that_cannot_be_had_is_planned_again_not_paid_for():
    """The whole-step window of every function is planned on the step function as the policy sees
    it (`Plan.whole`); where the probes find it cannot be one of whole steps when it is due (the
    step function found irregular, or no longer kept) it is not run, and the intervals that were
    to pay for it plan again (`Policy.whole_missed`), twice in a session at most."""
    from gputrace.tracer.calibrate import ProbeCost as PC

    h200 = PC(entry_ns=718.5, entry_return_ns=1249.9, bias_ns=470.2)
    rates = [370116, 112750, 37032, 8076, 6211, 5944, 3424, 2483, 1682, 1682, 1553, 1307, 359, 65, 63]
    cls = [QUERY, QUERY, SUB, QUERY, QUERY, SUB, QUERY, QUERY, QUERY, QUERY, SUB, QUERY, STATE, SYNC, SUB]
    p = scouted(dict(enumerate(cls)), {f: h200 for f in range(15)}, {f: max(1, int(r * 0.003)) for f, r in enumerate(rates)},
                scout_s=0.003, budget=0.01, interval_s=1.0)

    def next_plan():
        p.observe_kept({14: 63.0})
        p.observe_exposure(None)
        plan = p.plan()
        p.observe(len(plan.windows), {f: r for f, r in enumerate(rates) if f in plan.probe and f not in p.kept},
                  {f: 10 for f in plan.probe})
        return plan

    assert not next_plan().whole  # the interval that times every function
    plan = next_plan()
    for miss in range(3):
        assert plan.whole and plan.step == 14 and len(plan.probe) == 15, (miss, plan)
        waits = next_plan()  # paid for: the waits alone, and their reference
        assert waits.timed == frozenset({13}) and waits.probe - {waits.marker} == {13}
        p.whole_missed()
        nxt = [next_plan() for _ in range(2)]
        if miss < 2:
            plan = next(x for x in nxt if x.whole)  # planned again
        else:
            assert all(x.probe - {x.marker} == {13} for x in nxt)  # the third stays paid for: the waits alone


def test_a_long_step_window_is_armed_at_the_step_the_program_measured_not_at_its_counted_rate():
    """A step longer than STEP_FRESH_MAX_S is armed by extrapolating from the step function's last
    call. Its rate (`Plan.step_hz`) is its calls counted over an interval, 6 or 7 a second of a
    150-ms step: at 6.15/s the call aimed at was taken 162.5 ms after the last, 12 ms late, and the
    window waited a whole step more with its links on (simcuda, a 150-ms step: 2 of 10 whole
    windows waited 137 ms). The program has the step exactly: the mean gap between its calls. And
    it is armed STEP_JITTER of a step early, as a step under STEP_FRESH_MAX_S is."""
    import time

    from gputrace import simcuda
    from gputrace.tracer import probes as pr
    from gputrace.tracer.budget import Plan
    from gputrace.tracer.symbols import read_functions

    last = time.monotonic() - 0.007  # the step function's last call, 7 ms ago

    class Prog:
        def set_hit_costs(self, *a) -> None:
            pass

        def step_last(self) -> float:
            return last

        def step_gaps(self) -> tuple[int, float, float]:
            return 20, 0.15015, 0.0003

    lib = str(simcuda.library_path())
    functions = tuple(read_functions(lib))[:8]
    p = pr.Probes(lib, functions, Prog(), CALIBRATION, pid=1)
    p.attach_s = [0.006]
    starts = []

    def wait(seconds: float) -> bool:
        starts.append(time.monotonic() + seconds)  # when the links would start attaching
        return False  # the job is gone: nothing is attached

    probe = frozenset(range(8))
    plan = Plan(True, ((0.0, 0.1626),), frozenset(), probe, step=3, period_s=0.1626, step_hz=6.15)
    assert p._step_window(plan, 0.1626, probe, wait) is False
    # Attached, and armed, just before the call aimed at, by STEP_JITTER of a step (its own jitter).
    due = starts[0] + 0.006 + pr.STEP_ARM_LEAD_S + pr.STEP_JITTER * 0.15015
    assert due == pytest.approx(last + 0.15015, abs=0.002), (due - last)


def test_a_wait_ends_at_its_deadline_not_at_the_next_whole_millisecond(monkeypatch):
    """poll() takes whole milliseconds and rounds a fraction up (a 2.3-ms wait took 3.1 ms here): every
    window of time ran past its plan. A wait polls the whole milliseconds and sleeps the rest (the
    loop's, for a Session's one pidfd as for a HostSession's epoll of many)."""
    from gputrace.tracer import loop

    clock = [100.0]
    polls: list[int] = []
    sleeps: list[float] = []

    class Me(loop.Loop):
        def _stopped(self) -> bool:
            return False

        def _poll(self, ms: int) -> None:
            assert isinstance(ms, int)
            polls.append(ms)
            clock[0] += ms / 1000

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock[0] += s

    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(loop.time, "sleep", sleep)
    me = Me()
    assert me._wait(0.0023) is True
    assert polls == [2] and sleeps == [pytest.approx(0.0003)]
    assert clock[0] == pytest.approx(100.0023)
    polls.clear(), sleeps.clear()
    assert me._wait(0.0004) is True
    assert polls == [] and sleeps == [pytest.approx(0.0004)]


def test_a_step_window_whose_step_function_has_gone_quiet_is_not_armed():
    """Polled for STEP_FRESH_WAIT steps and no call of the step function came (the job evaluates,
    checkpoints, or has ended its training): arming anyway held every link on for 2 (steps + 1)
    periods for a window that never opened. Not run, logged, and a whole one planned again."""
    from gputrace import simcuda
    from gputrace.tracer import probes as pr
    from gputrace.tracer.budget import Plan
    from gputrace.tracer.symbols import read_functions

    class Prog:
        def set_hit_costs(self, *a) -> None:
            pass

        def step_last(self) -> float:
            return 1.0  # its last call, long ago; no new one comes

        def step_gaps(self) -> tuple[int, float, float]:
            return 20, 0.01, 0.05

        def arm(self, *a) -> None:
            raise AssertionError("armed with no call of the step function in sight")

    lib = str(simcuda.library_path())
    functions = tuple(read_functions(lib))[:8]
    p = pr.Probes(lib, functions, Prog(), CALIBRATION, pid=1)
    p.attach_s = [0.001]
    p.attach = lambda *a, **k: (_ for _ in ()).throw(AssertionError("links attached"))
    probe = frozenset(range(8))
    plan = Plan(True, ((0.0, 0.01),), frozenset(), probe, step=3, period_s=0.01, step_hz=100.0, whole=True)
    assert p._step_window(plan, 0.01, probe, lambda s: True) is True
    assert p.step_log[-1].outcome == "step function not called, not run"
    assert p.log.whole_missed


# --- rates that are not known ------------------------------------------------------------------------------------------

def test_a_rate_whose_interval_is_wider_than_half_of_it_or_rests_on_few_calls_is_not_known():
    from gputrace.tracer.model import unknown_reason

    assert unknown_reason(5000, 100_000.0, 50_000.0) is None  # exactly half: known
    assert "95% interval" in unknown_reason(5000, 100_000.0, 50_001.0)
    assert "rests on 9 calls" in unknown_reason(9, 100_000.0, 1_000.0)
    assert unknown_reason(3, 40.0, 0.0) is None  # counted throughout
    assert unknown_reason(0, 0.0, 300.0) is None  # a sampled 0: no call seen is what was seen
    assert unknown_reason(1, 0.1, 8.0) is None  # +-8 calls/s: moves no audit
    assert unknown_reason(500, 1000.0, None) == "no interval could be stated"


def _snapshot(funcs, wait=0.5):
    from gputrace.tracer.model import ClassTotals, FunctionStats, ProcessSnapshot, unknown_reason

    fs = tuple(FunctionStats(n, SUB, obs, rate * 5, rate, err, 0, 100.0, 100.0, None, None,
                             not_known=unknown_reason(obs, rate, err)) for n, obs, rate, err in funcs)
    rate = sum(f.rate_hz for f in fs)
    err = sum(f.rate_err_hz for f in fs)
    cls = ClassTotals(SUB, rate, 0.1, err, unknown_reason(sum(f.calls_observed for f in fs), rate, err))
    return ProcessSnapshot(1, "job", 5.0, 0.05, None, fs, 0.01, 0.1, wait, (cls,))


def test_a_rate_not_known_is_null_in_json_with_its_range_and_comes_back_as_estimated():
    from gputrace.tracer.model import ProcessSnapshot

    s = _snapshot([("cuLaunchKernel", 5000, 100_000.0, 10_000.0), ("cuLaunchKernelEx", 40, 20_000.0, 15_000.0)])
    assert s.calls_not_known is None and s.shown_calls_hz == 120_000.0  # the whole is known: 25k of 120k
    d = s.to_dict()
    known, unknown = d["functions"]
    assert known["rate_hz"] == 100_000.0 and known["not_known"] is None
    assert unknown["rate_hz"] is None and unknown["calls_estimated"] is None and unknown["rate_err_hz"] is None
    assert unknown["rate_range_hz"] == [5_000.0, 35_000.0] and "95% interval" in unknown["not_known"]
    back = ProcessSnapshot.from_dict(d)
    assert back.functions[1].rate_hz == 20_000.0 and back.functions[1].rate_err_hz == 15_000.0
    assert back.functions[1].not_known == s.functions[1].not_known
    wide = _snapshot([("cuLaunchKernel", 40, 100_000.0, 90_000.0)])
    assert wide.calls_not_known and wide.to_dict()["calls_hz"] is None and wide.to_dict()["classes"][0]["rate_hz"] is None


def test_an_audit_of_a_rate_not_known_gives_the_bounds_over_its_interval_and_no_point():
    from gputrace.tracer.audit import INDIRECT_MAX, make_preset, audit

    s = _snapshot([("cuLaunchKernel", 40, 100_000.0, 90_000.0)], wait=0.0)
    a = audit(s, make_preset("shim", cost_ns=1000.0))
    assert a.not_known and a.slowdown_upper == a.slowdown_upper_max == pytest.approx(0.19 * INDIRECT_MAX)
    assert a.slowdown_lower == a.slowdown_lower_min == pytest.approx(0.01)
    d = a.to_dict()
    assert d["intercepted_hz"] is None and d["added_cpu_s_per_s"] is None and d["slowdown_upper"] == a.slowdown_upper
    ok = audit(_snapshot([("cuLaunchKernel", 5000, 100_000.0, 10_000.0)], wait=0.0), make_preset("shim", cost_ns=1000.0))
    assert ok.not_known is None and ok.slowdown_upper == pytest.approx(0.1 * INDIRECT_MAX)


def test_a_reference_whose_span_shows_its_probes_took_too_much_gives_way_to_a_spare():
    """A window's marker is picked at the rates of the interval before; where the job's rates rose
    since (an H100 job switching from its set-up to eager steps: its marker's probes took 22% of
    their span) the estimator cannot read the window against it. The probes see that as the span
    ends (its calls at their calibrated cost over its length) and probe, for as long, the first
    spare that stays within half of REF_PROBE_MAX at the same rise; the window, and the interval's
    next, are read against that one. A marker within REF_PROBE_MAX is kept."""
    import time

    from gputrace import simcuda
    from gputrace.tracer import probes as pr
    from gputrace.tracer.budget import Plan
    from gputrace.tracer.estimator import REF_PROBE_MAX
    from gputrace.tracer.symbols import read_functions

    lib = str(simcuda.library_path())
    functions = tuple(read_functions(lib))[:8]
    entry_s = {}
    rates_hz = {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}  # the job's true rates, set per case

    class Prog:
        def __init__(self) -> None:
            self.marker: int | None = None
            self.since = 0.0
            self.out = {f: 0 for f in range(8)}

        def set_hit_costs(self, *a) -> None:
            pass

        def seen_hits(self) -> int:
            return 0

        def kept_hits(self) -> int:
            return 0

        def outside(self) -> None:
            self.since = time.monotonic()

        def close_counting(self) -> None:
            if self.marker is not None and self.since:
                self.out[self.marker] += round(rates_hz[self.marker] * (time.monotonic() - self.since))
            self.since = 0.0

        def open(self) -> None:
            pass

        def outside_calls(self, tgid: int, f: int) -> int:
            return self.out[f]

    prog = Prog()
    entry_s.update({f: c.entry_ns * 1e-9 for f, c in pr.Probes(lib, functions, prog, CALIBRATION).costs.items()})

    class Link:
        fds = [1]

        def close(self) -> None:
            pass

    def attach(ids, cookies, retprobe):
        if cookies and cookies[0] & pr.COOKIE_MARKER:
            prog.marker = ids[0]
        return Link()

    def run(rates: dict[int, float], marker_share: float) -> pr.Probes:
        rates_hz.update(rates)
        p = pr.Probes(lib, functions, prog, CALIBRATION, pid=1)
        p._attach = attach  # type: ignore[method-assign]
        p.attach = lambda timed, probe=None: None  # type: ignore[method-assign]
        p._finish_window = lambda: (p.log.windows.append(p._current), 0.0)[1]  # type: ignore[method-assign]
        plan = Plan(True, ((0.03, 0.01), (0.09, 0.01)), frozenset(), frozenset({0, 1, 2, 3}), 0,
                    marker_share=marker_share, spares=((1, 0.02), (2, 0.004), (3, 0.001)))
        p.window(plan, 0.2, False, lambda s: (time.sleep(max(0.0, s)), True)[1])
        return p

    # The marker's probes take 4x the share the plan expected: the first spare within half of
    # REF_PROBE_MAX at 4x is function 2 (function 1 would take 8%).
    share = 0.04 * 4
    p = run({0: share / entry_s[0], 1: 0.08 / entry_s[1], 2: 0.016 / entry_s[2], 3: 0.004 / entry_s[3]}, 0.04)
    assert [w.marker for w in p.log.windows] == [2, 2], p.log.windows
    assert prog.out[2] > 0 and all(w.outside_s > 0.005 for w in p.log.windows)
    # Within REF_PROBE_MAX: kept.
    p = run({0: 0.8 * REF_PROBE_MAX / entry_s[0]}, 0.04)
    assert [w.marker for w in p.log.windows] == [0, 0]


def test_a_reference_is_picked_with_room_to_spare_where_one_has_it():
    """The marker is the most-called function whose probes take at most half of REF_PROBE_MAX of its
    span, where one does (its share is judged at a rate that may read low, and rates move), else the
    most-called within REF_PROBE_MAX; the plan carries the others that have room as spares."""
    from gputrace.tracer.estimator import REF_PROBE_MAX

    classes = {0: QUERY, 1: QUERY, 2: SUB}
    costs = {f: CHEAP for f in classes}
    hit = CHEAP.cost_ns(False) * 1e-9
    hz = {0: 0.9 * REF_PROBE_MAX / hit, 1: 0.3 * REF_PROBE_MAX / hit, 2: 0.1 * REF_PROBE_MAX / hit}
    p = scouted(classes, costs, {f: max(20, int(r * 0.004)) for f, r in hz.items()}, scout_s=0.004)
    p.rates.update(hz)
    assert p.reference(frozenset(classes)) == 1
    assert p.reference(frozenset({0, 2})) == 2
    hz[2] = 0.8 * REF_PROBE_MAX / hit
    p.rates.update(hz)
    assert p.reference(frozenset({0, 2})) == 0  # none with room: the most-called within REF_PROBE_MAX
    assert p.spares(1, frozenset(classes)) == ()  # 0 and 2 take more than half of it


def test_a_kept_functions_rate_is_its_exact_count_not_mixed_with_a_windows():
    """GPT-2 on an H100: the step's copy, kept at 63 calls a second, counted once in a 3-ms window
    that timed every function (333 a second there); averaged with that, the step was planned at 5 ms
    for a 13-ms step and its step window refused as "not called lately"."""
    p = scouted({0: QUERY, 1: SUB, 2: QUERY}, {f: CHEAP for f in range(3)}, {0: 50, 1: 1, 2: 10}, budget=0.01,
                interval_s=1.0, rare_share=0.0)
    p.observe_kept({1: 63.0})
    assert p.kept == frozenset({1})
    p.observe(1, {0: 10_000.0, 1: 333.0, 2: 2_000.0}, {0: 30, 1: 1, 2: 6})
    assert p.rates[1] == 63.0
    assert p.period_s(0.0) == pytest.approx(1 / 63.0)


def test_the_step_function_stays_while_another_is_as_slow():
    """Two kept functions called once a step at one rate (a conv net on an H100) must not take turns
    as the step: each step window would count another's steps."""
    p = scouted({0: QUERY, 1: SUB, 2: SUB}, {f: CHEAP for f in range(3)}, {0: 50, 1: 1, 2: 1}, budget=0.01,
                interval_s=1.0, rare_share=0.0)
    p.kept = frozenset({1, 2})  # (both cheap enough to count every call)
    p.observe_kept({1: 400.0, 2: 401.0})
    assert p.step_of(0.0)[0] == 1
    p.observe_kept({1: 402.0, 2: 399.0})
    assert p.step_of(0.0)[0] == 1  # (the slowest now: 2)
    p.observe_kept({1: 500.0, 2: 399.0})
    assert p.step_of(0.0)[0] == 2  # far slower: that one


def test_a_once_a_step_function_kept_as_the_step_stays_kept_and_is_priced_at_its_counted_rate():
    """This project's CI host, a 0.55-ms step: a getter 40 times a step and three functions once a
    step at 1.8k calls/s, a calibrated 624 ns a probe, the exposure not measured (planned at its
    most). Read through that exposure the windows said 2.2k/s, and at that rate counting one of the
    three every call cost 0.41% of the job, past STEP_KEEP_SHARE: none was kept, no window had a
    kept function's calls for its reference, and the three read 5-19% high. Priced at their rate as
    counted in the windows, one is kept; and it stays kept while the windows' few calls of each
    (3-7 a window) make a different one the cheapest from one interval to the next: a reference
    counted throughout its interval is what the windows are read against."""
    from gputrace.tracer.budget import STEP_KEEP_SHARE
    from gputrace.tracer.estimator import EXPOSURE_MAX

    classes = {0: QUERY, 1: QUERY, 2: SUB, 3: STATE}
    costs = {f: ProbeCost(entry_ns=624.0, entry_return_ns=1210.0, bias_ns=452.0) for f in classes}
    assert EXPOSURE_MAX * 2200 * 624e-9 > STEP_KEEP_SHARE * PLAN_SHARE * 0.01 >= EXPOSURE_MAX * 1800 * 624e-9
    p = policy(classes, costs)
    p.plan()
    p.observe(1, {0: 88e3, 1: 2200.0, 2: 2200.0, 3: 2200.0}, {0: 240, 1: 6, 2: 6, 3: 6},
              {0: 72e3, 1: 1800.0, 2: 1800.0, 3: 1800.0})
    assert len(p.kept & {1, 2, 3}) == 1
    (step,) = p.kept & {1, 2, 3}
    rng = random.Random(3)
    for _ in range(6):
        p.plan()
        # The windows' few calls of each: now one, now another reads a little lower.
        low = {f: 1800.0 * rng.uniform(0.7, 1.3) for f in (1, 2, 3) if f != step}
        p.observe_kept({step: 1800.0})  # its exact count, before the windows' (as tracer/tracee.py)
        p.observe(2, {0: 88e3} | {f: 1.2 * r for f, r in low.items()}, {0: 240} | {f: 6 for f in low}, {0: 72e3} | low)
        assert p.kept & {1, 2, 3} == {step}


def test_a_rate_its_calls_measured_time_rules_out_is_not_known_nor_any_sum_it_is_in(procs_one_thread):
    """A function counted at 2.5M calls a second (exactly, on the watch link) whose timed calls took 2
    us each, in a process of one thread: it would keep five threads inside the call. Not shown as a
    rate, nor its class's sum, nor the process's calls/s; at 750k a second (1.5 threads: a thread
    waiting in the call all the time, read some way over, is within the margin) it is."""
    from gputrace.tracer.bpfprog import ZERO, RawStats
    from gputrace.tracer.model import IMPLAUSIBLE, implausible
    from gputrace.tracer.probes import IntervalLog, WindowSpan

    assert implausible(2.5e6, 2000.0, 1).startswith(IMPLAUSIBLE) and implausible(2.5e6, 2000.0, 3) is None
    assert implausible(2.5e6, None, 1) is None and implausible(2.5e6, 2000.0, None) is None
    for rate, known in ((2_500_000, False), (750_000, True)):
        t = _one_function_tracee(procs_one_thread.pid)
        t.begin()
        timed = RawStats(100, 100, 100 * 2300, 100 * 2300, 0, 0, ZERO.hist)  # 2.3 us less the 300-ns bias
        log = IntervalLog([WindowSpan(0.01, frozenset({0}), frozenset({0}))], {})  # on the watch link throughout
        snap = t.account(1.0, log, [{0: timed}], {0: timed + RawStats(0, 0, 0, 0, 0, 0, ZERO.hist, watched=rate)})
        (f,) = snap.functions
        assert f.rate_hz == pytest.approx(rate) and f.mean_ns == pytest.approx(2000.0)
        assert (f.not_known is None) is known, f.not_known
        (sub,) = [c for c in snap.classes if c.cls is SUB]
        assert (sub.not_known is None) is known and (snap.calls_not_known is None) is known
        if not known:
            assert "would keep 5.0 threads in it; the process has 1" in f.not_known
            assert snap.to_dict()["functions"][0]["rate_hz"] is None and snap.shown_calls_hz is None


@pytest.fixture
def procs_one_thread():
    """A process of one thread (sleep), killed at teardown."""
    import subprocess

    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()
