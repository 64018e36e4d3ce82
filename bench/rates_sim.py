#!/usr/bin/env python3
"""The tracer's rates against the truth on simcuda, on this machine: the CI marks of the tracer-rates
work, measured as a user runs the tool (the CLI, its JSON), with seeded random clients.

A client is a simcuda `phases` job (simcuda/workloads/phases.c): steps of 3 to 10 driver calls (1 to 4
functions, each a fixed count a step: in lockstep) and CPU work of 20 us to 200 ms a step; a quarter
of them also synchronize once a step. Its log gives every function's exact calls in any span
(simcuda/truth.py). A probe hit costs about 9 us on this project's CI machines (a stepped one; 0.5 us
an emulated one): the hardest case for the estimator.

  attach: `gputrace attach -p PID -d 5 --json` on a client already running; every function above
    1k calls/s within +-15% of the truth over the session's span, its stated 95% interval covering
    it, and each function's rate over the busiest one's within +-5% of their true ratio (lockstep);
    a quarter of these clients (drawn apart: the others are the clients the same seed made before)
    also run a second thread calling a getter 300-2000 times a second at its own pace (`--side`),
    outside the lockstep;
  short: a client of 1 s traced from its start (`gputrace attach --json -- CLIENT`): every function's
    calls over the session within +-25% of the truth, or said not known;
  top: two clients at once on the two cores, read by `gputrace top --once --json` (as long as it
    decides): each one's calls/s within +-25% of its truth over the row's span, or not known.

    sudo .venv/bin/python bench/rates_sim.py --out bench/results/rates-sim [--runs 30] [--seed 1]

Writes OUT/rates.json (every row, rewritten as it goes) and OUT/README.md (the summary), and prints
the summary. About 15 s a run of `attach`, 5 s of `short`, 10-20 s of `top`.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from gputrace.simcuda.truth import PhaseLog, phases_env, start_phases

CLI = [sys.executable, "-m", "gputrace"]
NAMES = ["getdev", "state", "current", "attr", "capturing", "meminfo", "launch", "event"]
FULL = {"getdev": "cuCtxGetDevice_v2", "state": "cuDevicePrimaryCtxGetState", "current": "cuCtxGetCurrent",
        "attr": "cuDeviceGetAttribute", "capturing": "cuStreamIsCapturing", "meminfo": "cuMemGetInfo_v2",
        "launch": "cuLaunchKernel", "event": "cuEventRecord"}
STEP_NS = [20_000, 50_000, 200_000, 1_000_000, 5_000_000, 20_000_000, 200_000_000]
HOT_HZ = 1000.0
ATTACH_TOL, LOCKSTEP_TOL, SHORT_TOL, TOP_TOL = 0.15, 0.05, 0.25, 0.25


def client(rng: random.Random) -> str:
    """One phase's spec, without its length: 3 to 10 calls a step of 1 to 4 functions, CPU work a step."""
    k = rng.randint(1, 4)
    names = rng.sample(NAMES, k)
    total = rng.randint(max(3, k), 10)
    counts = [1] * k
    for _ in range(total - k):
        counts[rng.randrange(k)] += 1
    spec = ",".join(f"{n}={c}" for n, c in zip(names, counts))
    if rng.random() < 0.25:
        spec += ",sync=1"
    return spec + f",spin={rng.choice(STEP_NS)}"


SIDE_SHARE = 0.25
SIDE_HZ = (300, 1000, 2000)
_SIDE_SEED = [0]  # (main sets it: the side threads are drawn apart, so the clients stay as seeded before them)


def side(spec: str, i: int) -> list[str]:
    """In a quarter of the attach runs, a second thread calling a getter the steps do not at its own
    pace (`--side`: a framework's runtime thread), drawn from a generator of its own."""
    r = random.Random(1_000_003 * _SIDE_SEED[0] + i)
    if r.random() >= SIDE_SHARE:
        return []
    used = {part.split("=")[0] for part in spec.split(",")}
    name = r.choice([n for n in NAMES if n not in used and n != "launch"])
    return ["--side", f"{name}={r.choice(SIDE_HZ)}"]


def run_cli(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + argv, env=phases_env(), capture_output=True, text=True, timeout=timeout)


def end(job: subprocess.Popen) -> None:
    """Ends a client (SIGTERM: it writes its log first)."""
    if job.poll() is None:
        job.send_signal(signal.SIGTERM)
    job.wait(timeout=60)


def rate_of(f: dict) -> tuple[float | None, float | None, str | None]:
    """(rate, half-width, why not known) of a function of a report."""
    if f.get("rate_hz") is None:
        return None, None, f.get("not_known") or "not known"
    return f["rate_hz"], f.get("rate_err_hz"), None


def attach_run(i: int, rng: random.Random, tmp: Path) -> list[dict]:
    spec = client(rng)
    extra = side(spec, i)
    log = tmp / f"attach-{i}.json"
    job = start_phases([f"60:{spec}"], log, extra=extra)
    spec += f" {' '.join(extra)}" if extra else ""
    try:
        time.sleep(rng.uniform(0.2, 1.0))  # a random point of its run (no event to wait for: any moment will do)
        out = tmp / f"attach-{i}-report.json"
        r = run_cli(["attach", "-p", str(job.pid), "-d", "5", "--json", "-q", "-o", str(out)], 180)
    finally:
        end(job)
    if r.returncode:
        return [{"part": "attach", "run": i, "client": spec, "failed": r.stderr.strip()[-400:]}]
    rep = orjson.loads(out.read_bytes())
    truth = PhaseLog(log)
    t0 = rep["attach"]["started_monotonic_s"]
    ivs = rep["intervals"]
    a, b = t0 + ivs[0]["t_start"], t0 + ivs[-1]["t_start"] + ivs[-1]["interval_s"]
    calls = truth.calls(a, b)
    est = {f["name"]: f for f in rep["summary"]["functions"]}
    hot = {n: c / (b - a) for n, c in calls.items() if c / (b - a) >= HOT_HZ}
    rows = []
    apart = {FULL[extra[1].split("=")[0]]} if extra else set()  # the side thread's: not in the steps' lockstep
    steps = {n: r for n, r in hot.items() if n not in apart}
    busiest = max(steps, key=steps.get) if steps else None
    for name, true in hot.items():
        rate, err, why = rate_of(est.get(name, {"rate_hz": 0.0, "rate_err_hz": 0.0}))
        row = {"part": "attach", "run": i, "client": spec, "function": name, "truth_hz": true, "rate_hz": rate,
               "err_hz": err, "not_known": why, "span_s": b - a}
        if rate is not None:
            row["error"] = rate / true - 1
            row["covered"] = err is not None and abs(rate - true) <= err
            row["within"] = abs(row["error"]) <= ATTACH_TOL
            br = rate_of(est.get(busiest, {"rate_hz": None}))[0]
            if name != busiest and name not in apart and br:
                row["lockstep_error"] = (rate / br) / (true / hot[busiest]) - 1
        rows.append(row)
    return rows


def short_run(i: int, rng: random.Random, tmp: Path) -> list[dict]:
    spec = client(rng)
    log = tmp / f"short-{i}.json"
    out = tmp / f"short-{i}-report.json"
    from gputrace import simcuda

    argv = simcuda.workload("phases") + ["--phase", f"1:{spec}", "--log", str(log)]
    r = run_cli(["attach", "--json", "-q", "-o", str(out), "--", *argv], 180)
    if r.returncode:
        return [{"part": "short", "run": i, "client": spec, "failed": r.stderr.strip()[-400:]}]
    rep = orjson.loads(out.read_bytes())
    truth = PhaseLog(log)
    total = truth.calls(truth.t[0] - 1, truth.t[-1] + 1)
    est = {f["name"]: f for f in rep["summary"]["functions"]}
    rows = []
    for name, true in total.items():
        if true < 1000:
            continue  # the set-up calls: counted once each
        f = est.get(name, {"calls_estimated": 0.0})
        n = f.get("calls_estimated")
        why = (f.get("not_known") or "not known") if n is None else None
        row = {"part": "short", "run": i, "client": spec, "function": name, "truth_calls": true, "calls": n,
               "not_known": why}
        if why is None and n is not None:
            row["error"] = n / true - 1
            row["within"] = abs(row["error"]) <= SHORT_TOL
        rows.append(row)
    return rows


def top_run(i: int, rng: random.Random, tmp: Path) -> list[dict]:
    specs = [client(rng), client(rng)]
    logs = [tmp / f"top-{i}-{k}.json" for k in range(2)]
    jobs = [start_phases([f"120:{s}"], lg) for s, lg in zip(specs, logs)]
    try:
        r = run_cli(["top", "--once", "--json"], 180)
        t_end = time.monotonic()
    finally:
        for j in jobs:
            end(j)
    if r.returncode:
        return [{"part": "top", "run": i, "client": " | ".join(specs), "failed": r.stderr.strip()[-400:]}]
    doc = orjson.loads(r.stdout)
    rows = {p["pid"]: p for p in doc["processes"]}
    out = []
    for j, spec, lg in zip(jobs, specs, logs):
        truth = PhaseLog(lg)
        p = rows.get(j.pid)
        row = {"part": "top", "run": i, "client": spec}
        if p is None:
            row["not_known"] = "not listed" + (" (pending)" if j.pid in doc.get("pending", []) else "")
            out.append(row)
            continue
        snap = p["snapshot"]
        span = snap["interval_s"]
        calls = truth.calls(t_end - span, t_end)
        true = sum(c for n, c in calls.items()) / span
        row.update(truth_hz=true, rate_hz=snap["calls_hz"], span_s=span,
                   not_known=snap.get("calls_not_known") or snap.get("not_measured"))
        if snap["calls_hz"] is not None:
            row["error"] = snap["calls_hz"] / true - 1
            row["within"] = abs(row["error"]) <= TOP_TOL
        out.append(row)
    return out


def summarize(rows: list[dict]) -> str:
    lines = []
    for part, tol in (("attach", ATTACH_TOL), ("short", SHORT_TOL), ("top", TOP_TOL)):
        rs = [r for r in rows if r["part"] == part and "failed" not in r]
        errs = [r for r in rows if r["part"] == part and "failed" in r]
        known = [r for r in rs if "error" in r]
        unknown = [r for r in rs if r.get("not_known")]
        if not rs and not errs:
            continue
        within = sum(r["within"] for r in known)
        s = f"{part}: {len(rs)} rows; {within} of {len(known)} known within +-{tol:.0%}"
        if known:
            e = sorted(r["error"] for r in known)
            s += f" (errors {e[0]:+.1%} .. {e[-1]:+.1%}, median {statistics.median(e):+.1%})"
        s += f"; {len(unknown)} not known"
        if part == "attach":
            cov = [r for r in known if "covered" in r]
            s += f"; intervals cover the truth in {sum(r['covered'] for r in cov)} of {len(cov)}"
            ls = [abs(r["lockstep_error"]) for r in known if "lockstep_error" in r]
            if ls:
                s += (f"; lockstep ratios within +-{LOCKSTEP_TOL:.0%} in {sum(x <= LOCKSTEP_TOL for x in ls)} of "
                      f"{len(ls)} (worst {max(ls):.1%})")
        if errs:
            s += f"; {len(errs)} runs failed"
        lines.append(s)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=30, help="attach runs (short: a third of them; top: a sixth)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--parts", default="attach,short,top")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("rates_sim: the tracer needs root", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    _SIDE_SEED[0] = args.seed
    parts = args.parts.split(",")
    plan = [("attach", args.runs), ("short", max(1, args.runs // 3)), ("top", max(1, args.runs // 6))]
    rows: list[dict] = []
    head = {"seed": args.seed, "runs": args.runs, "commit": subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "host_cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="gputrace-rates-sim-") as td:
        for part, n in plan:
            if part not in parts:
                continue
            fn = {"attach": attach_run, "short": short_run, "top": top_run}[part]
            for i in range(n):
                t = time.monotonic()
                got = fn(i, rng, Path(td)) or [{"part": part, "run": i, "client": "(no busy function)"}]
                rows += [r for r in got if "function" in r or "failed" in r or part == "top"]
                bad = [r for r in got if r.get("within") is False or "failed" in r or r.get("covered") is False]
                print(f"{part} {i}: {got[0].get('client')} ({time.monotonic() - t:.0f} s)"
                      + "".join(f"\n   {r.get('function', '')} " + (r["failed"] if "failed" in r else
                                f"{r['error']:+.1%} (+-{(r.get('err_hz') or 0) / r.get('truth_hz', 1):.1%})")
                                for r in bad), file=sys.stderr, flush=True)
                (args.out / "rates.json").write_bytes(orjson.dumps({**head, "rows": rows}, option=orjson.OPT_INDENT_2))
    text = summarize(rows)
    (args.out / "README.md").write_text(f"# Tracer rates on simcuda ({head['commit']})\n\n"
                                        f"    {head['command']}\n\n" + "\n".join(f"- {ln}" for ln in text.splitlines())
                                        + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
