#!/usr/bin/env python3
"""Per 5-s attach of bench/audit_gpu.py runs: its step windows, and every function above 1k calls/s
that read outside +-10% of the truth (calls a step x the job's steps while attached), with its error
and stated 95% half-width:

    .venv/bin/python bench/audit_misses.py bench/results/audit-h200-13/run2{5,6,7,8,9}
"""
from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gputrace.tracer import estimator as est  # noqa: E402

for run in map(Path, sys.argv[1:]):
    for job in json.loads((run / "summary.json").read_text()):
        d = json.loads((run / f"{job}.json").read_text())
        per = d["exact"]["calls_per_step"]
        for p in d["tracer_pairs"]:
            if p["attach_s"] != 5:
                continue
            steps = p["session_steps_per_s"] or p["untraced_steps_per_s"]
            obs, _ = est.load_observations(json.loads(lzma.open(run / (p["attach_file"][:-5] + ".obs.json.xz")).read()))
            nsw = sum(1 for o in obs for w in o.windows if w.steps)
            bad, n = [], 0
            for name, (r, e) in p["rates"].items():
                t = per.get(name, 0) * steps
                if t < 1000:
                    continue
                n += 1
                if abs(r / t - 1) > 0.1:
                    bad.append(f"{name} {100 * (r / t - 1):+.1f}%±{100 * e / t:.0f}")
            print(run.name, job, p["rep"], f"stepwin={nsw} intervals={len(obs)}", f"{n - len(bad)}/{n}", "; ".join(bad))
