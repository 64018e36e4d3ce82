#!/usr/bin/env python3
"""The committed GPU rates runs (bench/rates_gpu.py) read again by the tree's estimator, no GPU needed.

Each run's saved observations (raw.tar.xz) go through tracer/estimator.py with the exposure worked out
from them as the tracer does; the truth is each job's exact calls a step times its steps while attached.
Per run, over (attach, function above 1k calls/s) pairs: known, inside their stated 95% intervals,
within 10%, and per job the largest lockstep spread (functions called a whole number of times a step,
known: the largest over the smallest of estimate / truth, less 1). What a change of the estimator does
to figures measured on a GPU, before a GPU runs it again:

    .venv/bin/python bench/rates_replay.py [RUN ...]      (default: every bench/results/rates-h100-* run)

tests/test_estimator.py holds the same replay to its marks."""

from __future__ import annotations

import argparse
import lzma
import sys
import tarfile
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = ["rates-h100-2", "rates-h100-3/1-jax-mlp", "rates-h100-4", "rates-h100-5", "rates-h100-5/top", "rates-h100-6",
        "rates-h100-7"]


def known(e) -> bool:
    """As the reports say it: a 95% half-width at most half the rate, and 10 calls seen."""
    return e.err_hz <= 0.5 * e.rate_hz and e.calls_observed >= 10


def replayed(run: str) -> list[tuple[str, str, str, float, float, object]]:
    """Every (attach, function above 1k calls/s) pair of a run: (job, attach, function, true rate,
    calls a step, estimate)."""
    from gputrace.tracer import estimator as est

    root = RESULTS / run
    doc = orjson.loads(lzma.open(root / "rates.json.xz").read())
    tar = tarfile.open(root / "raw.tar.xz")
    saved = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
    out = []
    for job in doc["order"]:
        j = doc["jobs"].get(job) or {}
        per_step = (j.get("exact") or {}).get("calls_per_step")
        for at in j.get("attaches", []) if per_step else []:
            d = orjson.loads(tar.extractfile(saved[Path(at["observations"]).name]).read())
            obs, _ = est.load_observations(d)
            pools = est.MarkerPools()
            for o in obs:
                hz = est.step_rates([o])
                for w in o.windows:
                    pools.add(w, hz.get(w.step_func) if w.step_func is not None else None)
            for f, e in est.estimate(obs, pools.exposures()).items():
                name = d["functions"][str(f)]
                k = per_step.get(name, 0.0)
                if k * at["steps_per_s"] >= 1000:
                    out.append((job, at["observations"], name, k * at["steps_per_s"], k, e))
    return out


def summary(run: str) -> dict:
    pairs = replayed(run)
    good = [p for p in pairs if known(p[5])]
    spread: dict[str, float] = {}
    for a in {p[1] for p in good}:
        rel = [p[5].rate_hz / p[3] for p in good if p[1] == a and abs(p[4] - round(p[4])) < 0.01]
        if len(rel) >= 2:
            job = next(p[0] for p in good if p[1] == a)
            spread[job] = max(spread.get(job, 0.0), max(rel) / min(rel) - 1)
    return {"run": run, "pairs": len(pairs), "known": len(good),
            "covered": sum(abs(p[5].rate_hz - p[3]) <= p[5].err_hz for p in good),
            "within_10pct": sum(abs(p[5].rate_hz / p[3] - 1) <= 0.1 for p in good),
            "lockstep_spread": {k: round(v, 4) for k, v in sorted(spread.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", default=RUNS, help="runs under bench/results (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="one JSON object a run")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    total = {"pairs": 0, "known": 0, "covered": 0, "within_10pct": 0}
    for run in a.runs:
        s = summary(run)
        for k in total:
            total[k] += s[k]
        if a.json:
            print(orjson.dumps(s).decode())
        else:
            print(f"{run}: {s['pairs']} pairs, {s['known']} known, {s['covered']} covered, {s['within_10pct']} within 10%;"
                  f" lockstep spread {', '.join(f'{k} {v:.1%}' for k, v in s['lockstep_spread'].items()) or '-'}")
    if not a.json:
        print(f"all: {total['pairs']} pairs, {total['known']} known, {total['covered']} covered, "
              f"{total['within_10pct']} within 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
