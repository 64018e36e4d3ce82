#!/usr/bin/env python3
"""The tracer on a real GPU: what it costs the job it measures, and how right it is.

Measures, in one run on one machine:
  1. attach and detach time of uprobe links over every exported cu* function of the system libcuda;
  2. the calibrated probe cost per hit (entry only, entry + return) and the timing bias;
  3. a launch-bound PyTorch loop's speed untraced, under `--budget 1%` and under `--exact`, as paired,
     interleaved phases of one warm process (rotating the order each round), so machine drift hits
     every condition alike; slowdown = 1 - traced/untraced within a round;
  4. the rate error of the budgeted runs against the exact ones (functions above 1k calls/s);
  5. the audit's prediction for that loop and for a GPU-bound loop (large matmuls).

Run (root, real GPU, PyTorch):  python3 bench/tracer_gpu.py --out bench/results/tracer-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson

from gputrace.tracer.audit import PRESETS, audit
from gputrace.tracer.bpfprog import COOKIE_TIMED
from gputrace.tracer.session import Options, Session, open_program
from gputrace.tracer.symbols import read_functions
from gputrace.tracer.targets import resolve_for_command

HERE = Path(__file__).resolve().parent
TORCH_STEP = HERE.parent / "simcuda" / "workloads" / "torch_step.py"


class Workload:
    """torch_step.py --serve: warm once, then timed phases on request."""

    def __init__(self, mode: str, cpus: set[int] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, str(TORCH_STEP), "--serve", "--mode", mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"workload did not start: {line!r}")

    def phase(self, seconds: float) -> float:
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()
        self.last = orjson.loads(self.proc.stdout.readline())
        return self.last["steps_per_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def traced_phase(w: Workload, lib: str, prog, budget: float, seconds: float, interval: float):
    s = Session(w.proc.pid, lib, Options(interval, budget), program=prog)
    if budget >= 1.0:
        s.prime()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("summary", s.run(seconds)))
    t.start()
    speed = w.phase(seconds)
    t.join()
    s.close()
    return speed, out["summary"], s


def attach_detach(prog, lib: str, funcs, reps: int) -> dict:
    offs = [f.offset for f in funcs]
    att, det = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        links = [prog.attach(lib, offs, [i | COOKIE_TIMED for i in range(len(offs))], retprobe=True),
                 prog.attach(lib, offs, list(range(len(offs))), retprobe=False)]
        att.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for link in reversed(links):
            link.close()
        det.append(time.perf_counter() - t0)
    return {"functions": len(offs), "links": 2, "attach_s": att, "detach_s": det,
            "attach_s_median": statistics.median(att), "detach_s_median": statistics.median(det)}


def median_ci(xs: list[float], n: int = 2000) -> tuple[float, float, float]:
    """Median with a 95% bootstrap interval (seeded: the same data gives the same interval)."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return statistics.median(xs), meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def rates(summary) -> dict[str, float]:
    return {f.name: f.rate_hz for f in summary.functions}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--phase-s", type=float, default=4.0)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--cpus", default="", help="pin the workload to these CPUs (e.g. 2-5) and the tracer to others")
    args = ap.parse_args()
    cpus = None
    if args.cpus:
        lo, _, hi = args.cpus.partition("-")
        cpus = set(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - cpus)

    lib = resolve_for_command([sys.executable], os.environ)
    funcs = read_functions(lib)
    prog = open_program("auto", lambda m: print("warn:", m, file=sys.stderr))
    program, cal = prog
    result: dict = {"library": lib, "attach_mode": program.mode, "calibration": [dataclasses.asdict(cal)]}
    for _ in range(2):
        from gputrace.tracer.calibrate import calibrate
        result["calibration"].append(dataclasses.asdict(calibrate(program)))
    result["attach_detach"] = attach_detach(program, lib, funcs, 10)
    print("attach/detach:", result["attach_detach"]["attach_s_median"], result["attach_detach"]["detach_s_median"], flush=True)

    w = Workload("launch", cpus)
    conds = ["untraced", "budget", "exact"]
    rounds = []
    sums: dict[str, list] = {"budget": [], "exact": []}
    for r in range(args.rounds):
        row = {}
        for c in conds[r % 3:] + conds[: r % 3]:
            if c == "untraced":
                row[c] = w.phase(args.phase_s)
            else:
                speed, summ, sess = traced_phase(w, lib, prog, 1.0 if c == "exact" else args.budget, args.phase_s, args.interval)
                row[c] = speed
                row[c + "_steps"] = w.last["steps"]
                row[c + "_tracer_overhead"] = summ.tracer_overhead
                row[c + "_probed_share"] = summ.window_s / summ.interval_s if summ.interval_s else None
                sums[c].append(summ)
        row["slowdown_budget"] = 1 - row["budget"] / row["untraced"]
        row["slowdown_exact"] = 1 - row["exact"] / row["untraced"]
        print("round", r, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rounds.append(row)
    w.close()

    # Truth: calls per step, counted exactly (exact phases), times the untraced steps/s of the same
    # round. Budgeted runs estimate the untraced rate, so that is what they are held against.
    per_step: dict[str, list[float]] = {}
    for s, r in zip(sums["exact"], rounds):
        for f in s.functions:
            per_step.setdefault(f.name, []).append(f.calls_observed / r["exact_steps"])
    errs = {}
    for name, ps in per_step.items():
        k = statistics.median(ps)
        truth = [k * r["untraced"] for r in rounds]
        est = [rates(s).get(name, 0.0) for s in sums["budget"]]
        t = statistics.mean(truth)
        if t >= 1000:
            b = statistics.mean(est)
            errs[name] = {"calls_per_step": k, "untraced_hz": t, "budget_hz": b, "rel_error": (b - t) / t,
                          "stated_err_hz": statistics.mean(
                              next((f.rate_err_hz for f in s.functions if f.name == name), 0.0) for s in sums["budget"])}
    last_exact = sums["exact"][-1]
    result["launch_bound"] = {
        "rounds": rounds,
        "slowdown_budget_median_ci95": median_ci([r["slowdown_budget"] for r in rounds]),
        "slowdown_exact_median_ci95": median_ci([r["slowdown_exact"] for r in rounds]),
        "slowdown_budget_median": statistics.median(r["slowdown_budget"] for r in rounds),
        "slowdown_exact_median": statistics.median(r["slowdown_exact"] for r in rounds),
        "untraced_steps_per_s_median": statistics.median(r["untraced"] for r in rounds),
        "rate_error": errs,
        "rate_error_abs_max": max((abs(v["rel_error"]) for v in errs.values()), default=None),
        "audit": [dataclasses.asdict(audit(last_exact, p)) for p in PRESETS.values()],
        "exact_summary_top": [dataclasses.asdict(f) | {"hist": None} for f in last_exact.functions[:15]],
        "calls_hz": last_exact.calls_hz,
        "driver_cpu_s_per_s": last_exact.driver_cpu_s_per_s,
        "wait_s_per_s": last_exact.wait_s_per_s,
    }

    g = Workload("gpu", cpus)
    grow = []
    gsum = None
    for r in range(2):
        un = g.phase(args.phase_s)
        ex, gsum, _ = traced_phase(g, lib, prog, 1.0, args.phase_s, args.interval)
        grow.append({"untraced": un, "exact": ex, "slowdown_exact": 1 - ex / un})
    g.close()
    result["options"] = vars(args)
    result["gpu_bound"] = {
        "rounds": grow,
        "audit": [dataclasses.asdict(audit(gsum, p)) for p in PRESETS.values()],
        "calls_hz": gsum.calls_hz,
        "driver_cpu_s_per_s": gsum.driver_cpu_s_per_s,
        "wait_s_per_s": gsum.wait_s_per_s,
    }
    program.close()
    Path(args.out).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    lb = result["launch_bound"]
    b, e = lb["slowdown_budget_median_ci95"], lb["slowdown_exact_median_ci95"]
    print(f"launch-bound: untraced {lb['untraced_steps_per_s_median']:.0f} steps/s; slowdown at budget "
          f"{100 * b[0]:.2f}% (95% CI {100 * b[1]:.2f}..{100 * b[2]:.2f}), exact {100 * e[0]:.1f}% "
          f"({100 * e[1]:.1f}..{100 * e[2]:.1f}); rate error max {100 * (lb['rate_error_abs_max'] or 0):.1f}%")
    print(f"gpu-bound: exact slowdown {[round(100 * r['slowdown_exact'], 2) for r in grow]}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
