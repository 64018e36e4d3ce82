#!/usr/bin/env python3
"""The audit rounds' tables in bench/results/audit-h200.md, from bench/audit_gpu.py runs' files:

    .venv/bin/python bench/audit_table.py bench/results/audit-h200-11/run20 [RUN ...]
    .venv/bin/python bench/audit_table.py --summary bench/results/audit-h200-13/run2{5,6,7,8,9}
    .venv/bin/python bench/audit_table.py --misses bench/results/audit-h200-13/run2{5,6,7,8,9}

One row per (run, job, attach length): every function above 1k calls/s against the truth (calls per
step x the job's steps while attached): within +-10% / inside the stated 95% interval / pairs, the
largest error, the median stated half-width; then each attach's loss window by window / in whole
steps ('-': not measured by that run) / accounted, in %, with its number of step windows.

--summary: per (job, attach length) over all the runs given, the attaches' loss in whole steps
(median, range, and the median's distribution-free 95% interval), their accounted cost (median), the largest gap between the two, and the range
of the time-based paired slowdown. --misses: per attach (5 s), its step windows and every function
above 1k calls/s outside +-10%, with its error and stated half-width, and those within +-10% but
outside their stated interval. --step-log: per 5-s attach
whose report logs its step windows, those planned over every function it probed and the others
(the rarer functions' own), each with what came of it, the step lengths planned and, for those
counted whole, the time a step took. --whole: per job, its 5-s attaches with a whole-step window of
every function and those without, side by side (rates, cost), and the wait of the step windows from
arming to their opening call. --reestimate: the rates
worked out again from the observations each attach saved, by the estimator as it is now (the rows'
costs are the run's).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_gpu import read_json  # noqa: E402
from gputrace.tracer import estimator as est  # noqa: E402


REESTIMATE = False  # --reestimate: the rates worked out again from the saved observations


def attaches(run: Path):
    """(job, pair, observations, [(function, rate, half-width, truth) above 1k calls/s])."""
    for job in json.loads((run / "summary.json").read_text()):
        d = json.loads((run / f"{job}.json").read_text())
        per = d["exact"]["calls_per_step"]
        for p in d["tracer_pairs"]:
            steps = p["session_steps_per_s"] or p["untraced_steps_per_s"]
            doc = read_json(run / (p["attach_file"][:-5] + ".obs.json"))
            obs, expo = est.load_observations(doc)
            if REESTIMATE:
                names = doc["functions"]
                now = {names[str(f)]: [e.rate_hz, e.err_hz] for f, e in est.estimate(obs, expo).items()}
                p = p | {"rates": {k: now[k] for k in sorted(now, key=list(p["rates"]).index)}}
            hot = [(name, r, e, per.get(name, 0) * steps) for name, (r, e) in p["rates"].items()]
            yield job, p, obs, [h for h in hot if h[3] >= 1000]


def step_windows(obs) -> int:
    return sum(1 for o in obs for w in o.windows if w.steps)


def rows(run: Path) -> list[str]:
    out = []
    by: dict[tuple[str, float], dict] = {}
    for job, p, obs, hot in attaches(run):
        b = by.setdefault((job, p["attach_s"]), {"n": 0, "ok": 0, "cov": 0, "worst": 0.0, "cost": [], "half": []})
        for _, r, e, true in hot:
            b["n"] += 1
            b["ok"] += abs(r / true - 1) <= 0.1
            b["cov"] += abs(r - true) <= e
            b["worst"] = max(b["worst"], abs(r / true - 1))
            b["half"].append(e / true)
        b["cost"].append((p["slowdown_local"], p.get("slowdown_steps"), p["accounted"], step_windows(obs)))
    for (job, length), b in by.items():
        half = sorted(b["half"])[len(b["half"]) // 2] if b["half"] else float("nan")
        costs = ", ".join(f"{100 * a:.2f}/{'-' if w is None else f'{100 * w:.2f}'}/{100 * c:.2f} ({n})"
                          for a, w, c, n in b["cost"])
        out.append(f"| {run.name} | {job} | {length:.0f} s | {b['ok']} / {b['cov']} / {b['n']}; "
                   f"{100 * b['worst']:.1f}%; ±{100 * half:.0f}% | {costs} |")
    return out


def median_interval(xs: list[float]) -> tuple[float | None, float | None]:
    """The median's distribution-free 95% interval: the order statistics j..n+1-j, j the largest
    with P(Binomial(n, 1/2) < j) <= 2.5% (at least 95% coverage); None where n is too small for
    any (under 6: the range covers less)."""
    n, xs = len(xs), sorted(xs)
    j, below = 0, 0.0
    while True:
        below += math.comb(n, j) / 2 ** n
        if below > 0.025:
            break
        j += 1
    if j == 0:
        return None, None
    return xs[j - 1], xs[n - j]


def fmt_median(xs: list[float]) -> str:
    """'median% (range; the median's 95% interval)' in percent, '-' for none."""
    if not xs:
        return "-"
    lo, hi = median_interval(xs)
    return (f"{100 * statistics.median(xs):.2f}% ({100 * min(xs):.2f}..{100 * max(xs):.2f}; the median's 95% "
            f"interval {'-' if lo is None else f'{100 * lo:.2f}..{100 * hi:.2f}'})")


def summary(runs: list[Path]) -> list[str]:
    by: dict[tuple[str, float], list[dict]] = {}
    for run in runs:
        for job, p, _, _ in attaches(run):
            by.setdefault((job, p["attach_s"]), []).append(p)
    out = []
    for (job, length), ps in sorted(by.items()):
        steps = [p["slowdown_steps"] for p in ps if p.get("slowdown_steps") is not None]
        acc = [p["accounted"] for p in ps]
        timed = [p["slowdown"] for p in ps]
        gap = max((abs(p["slowdown_steps"] - p["accounted"]) for p in ps if p.get("slowdown_steps") is not None),
                  default=None)
        st = "-" if not steps else f"median {fmt_median(steps)}, {sum(s > 0.01 for s in steps)} above 1%"
        out.append(f"{job} {length:.0f} s, {len(ps)} attaches: in whole steps {st}; accounted median "
                   f"{100 * statistics.median(acc):.2f}%; largest gap {'-' if gap is None else f'{100 * gap:.2f}'} "
                   f"point; time-based {100 * min(timed):+.2f}..{100 * max(timed):+.2f}%")
    return out


def misses(run: Path) -> list[str]:
    out = []
    for job, p, obs, hot in attaches(run):
        if p["attach_s"] != 5:
            continue
        bad = [f"{name} {100 * (r / t - 1):+.1f}%±{100 * e / t:.0f}" for name, r, e, t in hot if abs(r / t - 1) > 0.1]
        out_ci = [f"{name} {100 * (r / t - 1):+.1f}%±{100 * e / t:.1f}" for name, r, e, t in hot
                  if abs(r - t) > e and abs(r / t - 1) <= 0.1]
        out.append(f"{run.name} {job} {p['rep']} stepwin={step_windows(obs)} intervals={len(obs)} "
                   f"{len(hot) - len(bad)}/{len(hot)} " + "; ".join(bad)
                   + (f" | outside its interval: {'; '.join(out_ci)}" if out_ci else ""))
    return out


def most_probed(obs) -> int:
    """The most functions one window of the attach probed (the scout's aside): a whole-step window
    of every function probes that many."""
    return max((len(w.probed) for o in obs for w in o.windows if not w.discovery and len(w.probed) < 100), default=0)


def whole_split(runs: list[Path]) -> list[str]:
    """Per job, its 5-s attaches with a whole-step window of every function it probed and those
    without: rates within +-10% / pairs, the loss in whole steps (median, its 95% interval) and the
    accounted cost (median); then, over the attaches whose report logs its step windows, the wait
    of its whole step windows from arming to the opening call."""
    by: dict[tuple[str, bool], list] = {}
    waits: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for job, p, obs, hot in attaches(run):
            if p["attach_s"] != 5:
                continue
            most = most_probed(obs)
            full = any(w.steps and len(w.probed) >= most for o in obs for w in o.windows)
            by.setdefault((job, full), []).append((p, hot))
            rep = read_json(run / p["attach_file"])
            tries = rep["attach"].get("step_windows")
            if tries is None:
                continue  # (no step log in its report)
            w = waits.setdefault(job, {"wait": [], "gap": [], "attach": []})
            if rep["attach"].get("attach_s_median") is not None:  # (an attach that attached no window)
                w["attach"].append(rep["attach"]["attach_s_median"])
            for t in tries:
                if t["outcome"] == "whole" and t["wait_s"] is not None:
                    w["wait"].append(t["wait_s"])
                    w["gap"].append(t["gap_mean_s"])
    out = []
    for (job, full), xs in sorted(by.items()):
        hot = [h for _, hs in xs for h in hs]
        ok = sum(abs(r / t - 1) <= 0.1 for _, r, _, t in hot)
        steps = [p["slowdown_steps"] for p, _ in xs if p.get("slowdown_steps") is not None]
        cost = fmt_median(steps)
        out.append(f"{job} 5 s, {'with' if full else 'without'} a whole-step window of every function: {len(xs)} "
                   f"attaches; rates {ok}/{len(hot)} within ±10%; in whole steps {cost}; accounted median "
                   f"{100 * statistics.median(p['accounted'] for p, _ in xs):.2f}%")
    for job, w in sorted(waits.items()):
        wt = w["wait"]
        if not wt:
            continue
        out.append(f"{job} 5 s: {len(wt)} step windows counted whole waited {1e3 * statistics.median(wt):.1f} ms "
                   f"(median; {1e3 * min(wt):.1f}..{1e3 * max(wt):.1f}) from arming to their opening call; the "
                   f"step function's mean gap then {1e3 * statistics.median(w['gap']):.1f} ms (median); the "
                   f"attaches' median link attach "
                   + (f"{1e3 * statistics.median(w['attach']):.1f} ms (median)" if w["attach"] else "not measured"))
    return out


def step_log(run: Path) -> list[str]:
    """Per 5-s attach whose report logs its step windows (attach.step_windows, from ec6222a on): the
    windows planned as whole steps of every function the attach probed, and what came of them."""
    out = []
    for job, p, obs, _ in attaches(run):
        if p["attach_s"] != 5:
            continue
        rep = read_json(run / p["attach_file"])
        tries = rep["attach"].get("step_windows")
        if tries is None:
            continue
        most = most_probed(obs)
        full = [t["outcome"] for t in tries if t["functions"] >= most]
        rare = [t["outcome"] for t in tries if t["functions"] < most and t["outcome"] != "shorter than a step"]
        periods = [t["period_s"] for t in tries]
        per_step = [t["span_s"] / t["steps"] for t in tries if t["outcome"] == "whole"]
        planned = f"{1e3 * min(periods):.1f}-{1e3 * max(periods):.1f} ms" if periods else "none"
        out.append(f"{run.name} {job} {p['rep']} of every function ({most}): {', '.join(full) or 'none planned'}; "
                   f"others: {', '.join(rare) or '-'}; planned step {planned}"
                   + (f", counted whole {1e3 * min(per_step):.1f}-{1e3 * max(per_step):.1f} ms a step" if per_step else ""))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--summary", action="store_true")
    mode.add_argument("--misses", action="store_true")
    mode.add_argument("--step-log", action="store_true")
    mode.add_argument("--whole", action="store_true")
    ap.add_argument("--reestimate", action="store_true")
    args = ap.parse_args()
    REESTIMATE = args.reestimate
    if args.summary or args.whole:
        print("\n".join(summary(args.runs) if args.summary else whole_split(args.runs)))
    else:
        for run in args.runs:
            print("\n".join(misses(run) if args.misses else step_log(run) if args.step_log else rows(run)))
