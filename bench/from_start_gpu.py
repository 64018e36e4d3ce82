#!/usr/bin/env python3
"""The tracer on jobs traced from their start, on a real GPU: a PyTorch job spends seconds importing
and setting up (few driver calls, long windows at the budget) before its loop (hundreds of
thousands of calls a second, short windows). Checks what a user sees then:

  1. `gputrace attach --exact -- JOB`: every call counted (calls_observed: its estimates are what the
     job would do untraced, and --exact slows it), which gives the job's driver calls per step;
  2. `gputrace attach -- JOB` at the default 1% budget: the session's estimated calls against
     (steps + warm-up steps) x calls per step from 1, and against the intervals' own rates
     weighted by their length;
  3. `gputrace top --once --json -d D` started together with two jobs (one under the shim): both
     found while they set up, and their loops' functions counted.

Run (root, real GPU, PyTorch; gputrace on PATH):
    python3 bench/from_start_gpu.py --out DIR
Writes DIR/from-start.json (and the raw reports beside it); `--reanalyze DIR` works the figures
out again from those.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCH_STEP = HERE.parent / "simcuda" / "workloads" / "torch_step.py"
WARMUP = 50  # torch_step.py's default --warmup steps


def job_cmd(seconds: float) -> list[str]:
    return [sys.executable, str(TORCH_STEP), "--mode", "launch", "--seconds", str(seconds), "--warmup", str(WARMUP)]


def last_json(text: str) -> dict:
    return json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])


def attach(out: Path, tag: str, seconds: float, extra: list[str]) -> dict:
    report = out / f"attach-{tag}.json"
    t = time.monotonic()
    r = subprocess.run(["gputrace", "attach", "--json", "-q", "-o", str(report), *extra, "--", *job_cmd(seconds)],
                       capture_output=True, text=True, timeout=seconds + 120)
    if r.returncode:
        sys.exit(f"attach {tag} failed ({r.returncode}): {r.stderr[-2000:]}")
    doc = json.loads(report.read_text())
    job = last_json(r.stdout)
    s = doc["summary"]
    calls = sum(f["calls_estimated"] for f in s["functions"])
    ivs = [(i["interval_s"], i["processes"][0]["calls_hz"]) for i in doc["intervals"] if i["processes"]]
    span = sum(a for a, _ in ivs)
    return {"wall_s": time.monotonic() - t, "job": job, "steps_total": job["steps"] + WARMUP,
            "session_s": s["interval_s"], "calls_estimated": calls, "calls_hz": s["calls_hz"],
            "tracer_overhead": s["tracer_overhead"],
            "intervals_weighted_hz": sum(a * r for a, r in ivs) / span if span else None,
            "interval_rates": [round(r) for _, r in ivs]}


def top_from_start(out: Path, duration: float) -> dict:
    report = out / "top-from-start.json"
    top = subprocess.Popen(["gputrace", "top", "--once", "--json", "-i", "1", "-d", str(duration)],
                           stdout=report.open("wb"), stderr=subprocess.PIPE, text=True)
    jobs = [subprocess.Popen(job_cmd(duration + 10), stdout=subprocess.PIPE, text=True),
            subprocess.Popen(["gputrace", "run", "--checkpointable", "--", *job_cmd(duration + 10)],
                             stdout=subprocess.PIPE, text=True)]
    _, err = top.communicate(timeout=duration + 120)
    if top.returncode:
        sys.exit(f"top failed ({top.returncode}): {err[-2000:]}")
    outs = [last_json(j.communicate(timeout=120)[0]) for j in jobs]
    doc = json.loads(report.read_text())
    rows = []
    for p in sorted(doc["processes"], key=lambda r: r["shimmed"]):
        s = p["snapshot"]
        called = sorted(((f["rate_hz"], f["name"]) for f in s["functions"] if f["calls_observed"]), reverse=True)
        rows.append({"pid": p["pid"], "shimmed": p["shimmed"], "session_s": s["interval_s"], "calls_hz": s["calls_hz"],
                     "history": [round(x) for x in p["calls_history"]], "top_functions": [n for _, n in called[:6]]})
    return {"processes": rows, "jobs": outs, "gpus": doc.get("gpus")}


def analyze(out: Path, res: dict) -> dict:
    """The budgeted session's estimates against the exact run's counts per step, per function and in all."""
    exact = {f["name"]: f["calls_observed"] for f in json.loads((out / "attach-exact.json").read_text())["summary"]["functions"]}
    budget = {f["name"]: f["calls_estimated"] for f in json.loads((out / "attach-budget.json").read_text())["summary"]["functions"]}
    se, sb = res["exact"]["steps_total"], res["budget"]["steps_total"]
    per_step = {n: c / se for n, c in exact.items()}
    loop = {n: p for n, p in per_step.items() if p >= 0.5}  # called in (nearly) every step
    res["calls_per_step"] = sum(per_step.values())
    res["per_function"] = {n: {"exact_per_step": p, "budget_per_step": budget.get(n, 0.0) / sb,
                               "ratio": budget.get(n, 0.0) / sb / p} for n, p in sorted(loop.items(), key=lambda x: -x[1])}
    expected = sb * sum(per_step.values())
    res["budget_expected_calls"] = expected
    res["budget_estimate_over_expected"] = res["budget"]["calls_estimated"] / expected
    res["budget_estimate_over_intervals"] = res["budget"]["calls_hz"] / res["budget"]["intervals_weighted_hz"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for the reports")
    ap.add_argument("--reanalyze", metavar="DIR", help="work the figures out again from DIR's reports")
    ap.add_argument("--seconds", type=float, default=20.0, help="each attached job's loop, after warm-up")
    ap.add_argument("--top-seconds", type=float, default=20.0)
    args = ap.parse_args()
    if args.reanalyze:
        out = Path(args.reanalyze)
        res = analyze(out, json.loads((out / "from-start.json").read_text()))
    else:
        if not args.out:
            ap.error("give --out DIR (or --reanalyze DIR)")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        res = {"exact": attach(out, "exact", args.seconds, ["--exact"]),
               "budget": attach(out, "budget", args.seconds, [])}
        res["top"] = top_from_start(out, args.top_seconds)
        res = analyze(out, res)
    (out / "from-start.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("exact", "budget", "top")}, indent=1))
    budget = res["budget"]
    print("budget summary", round(budget["calls_hz"]), "calls/s over", round(budget["session_s"], 1), "s;",
          "intervals", budget["interval_rates"])
    for p in res["top"]["processes"]:
        print("top", p["pid"], "shim" if p["shimmed"] else "plain", round(p["calls_hz"]), p["history"], p["top_functions"])


if __name__ == "__main__":
    main()
