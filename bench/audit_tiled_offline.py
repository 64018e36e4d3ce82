"""The rates of committed H200 attaches worked out again as if their intervals had tiled the session.

Before 090fdc1 an interval's span ran from the start of its windows, while its counts were the rows
read at its end less those read at the end of the interval before: the set-up between intervals
(50-120 ms after the first, a few ms after the others) was counted and not timed, and every exactly
counted rate read that much high. The saved observations hold both: each report's intervals give the
gaps, and widening each observation's span by the gap before it is what the tracer now records (the
time off the watch link was already tallied over the gaps). This re-estimates every 5-s attach of the
runs given both ways, against the truth audit_gpu.py took (calls a step times the job's steps/s while
attached), and prints, per job: the (attach, function above 1k calls/s) pairs within +-10%, inside
their stated 95% interval, and the median signed error.

    .venv/bin/python bench/audit_tiled_offline.py bench/results/audit-h200-11/run2{2,3,4}
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_gpu import read_json  # noqa: E402  (bench/, beside this file)



def gaps_before(report: dict) -> list[float]:
    """Per interval, the time between the end of the one before and its start (0 for the first)."""
    ivs = report["intervals"]
    return [0.0] + [max(0.0, b["t_start"] - a["t_start"] - a["interval_s"]) for a, b in zip(ivs, ivs[1:])]


def rows_of(doc: dict, obs_doc: dict, per_step: dict[str, float], steps_hz: float) -> list[tuple[str, float, bool]]:
    """(function, signed relative error, inside its interval) of every function above 1k calls/s."""
    from gputrace.tracer import estimator as est

    obs, expo = est.load_observations(obs_doc)
    names = obs_doc["functions"]
    out = []
    for f, e in est.estimate(obs, expo).items():
        true = per_step.get(names[str(f)], 0.0) * steps_hz
        if true >= 1000:
            out.append((names[str(f)], e.rate_hz / true - 1, abs(e.rate_hz - true) <= e.err_hz))
    return out


def fmt_range(r: list[float] | None) -> str:
    return "-" if r is None else f"{1e3 * r[0]:.0f}-{1e3 * r[1]:.0f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="audit_gpu.py result directories")
    ap.add_argument("--attach-s", type=float, default=5.0, help="the attaches of this length (0: every length)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    table: dict[str, dict[str, list]] = {}
    for d in args.runs:
        for path in sorted(d.glob("*.json")):
            if path.name == "summary.json" or "-attach-" in path.name:
                continue
            doc = orjson.loads(path.read_bytes())
            per_step = doc["exact"]["calls_per_step"]
            for p in doc["tracer_pairs"]:
                if args.attach_s and p["attach_s"] != args.attach_s:
                    continue
                report = read_json(d / p["attach_file"])
                obs_doc = read_json(d / Path(p["attach_file"]).with_suffix(".obs.json"))
                if report is None or obs_doc is None or len(obs_doc["observations"]) != len(report["intervals"]):
                    continue
                steps_hz = p.get("session_steps_per_s") or p["untraced_steps_per_s"]
                job = table.setdefault(doc["job"], {"as_run": [], "tiled": [], "gap_share": [], "gaps": []})
                job["as_run"].append(rows_of(doc, obs_doc, per_step, steps_hz))
                gaps = gaps_before(report)
                job["gaps"].append(gaps)
                for o, g in zip(obs_doc["observations"], gaps):
                    o["span_s"] += g
                job["tiled"].append(rows_of(doc, obs_doc, per_step, steps_hz))
                job["gap_share"].append(sum(gaps) / sum(o["span_s"] for o in obs_doc["observations"]))
    summary = {}
    for job, t in sorted(table.items()):
        after_first = [g[1] for g in t["gaps"] if len(g) > 1]
        others = [x for g in t["gaps"] for x in g[2:]]
        summary[job] = {"attaches": len(t["as_run"]), "gap_share_median": statistics.median(t["gap_share"]),
                        "gap_after_first_s": [min(after_first), max(after_first)] if after_first else None,
                        "gap_after_others_s": [min(others), max(others)] if others else None}
        for mode in ("as_run", "tiled"):
            rows = [r for rr in t[mode] for r in rr]
            summary[job][mode] = {
                "pairs": len(rows), "within_10pct": sum(abs(e) <= 0.10 for _, e, _ in rows),
                "covered": sum(c for _, _, c in rows),
                "median_rel_error": statistics.median(e for _, e, _ in rows) if rows else None}
        s = summary[job]
        length = f"{args.attach_s:g} s" if args.attach_s else "any length"
        print(f"{job}: {s['attaches']} attaches of {length}, gaps {100 * s['gap_share_median']:.1f}% "
              f"of the span (median); after the first interval {fmt_range(s['gap_after_first_s'])}, "
              f"after the others {fmt_range(s['gap_after_others_s'])}")
        for mode in ("as_run", "tiled"):
            m = s[mode]
            print(f"  {mode:7s} {m['within_10pct']}/{m['pairs']} within 10%, {m['covered']} inside their "
                  f"interval, median error {100 * m['median_rel_error']:+.1f}%")
    for mode in ("as_run", "tiled"):
        m = [summary[j][mode] for j in summary]
        print(f"all jobs, {mode}: {sum(x['pairs'] for x in m)} pairs, {sum(x['within_10pct'] for x in m)} within 10%, "
              f"{sum(x['covered'] for x in m)} inside their interval")
    if args.json:
        args.json.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
