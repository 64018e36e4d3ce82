#!/usr/bin/env python3
"""The eleventh round's table in bench/results/audit-h200.md, from a bench/audit_gpu.py run's files:

    .venv/bin/python bench/audit_table.py bench/results/audit-h200-11/run20 [RUN ...]

One row per (run, job, attach length): every function above 1k calls/s against the truth (calls per
step x the job's steps while attached): within +-10% / inside the stated 95% interval / pairs, the
largest error, the median stated half-width; then each attach's loss window by window / in whole
steps ('-': not measured by that run) / accounted, in %, with its number of step windows.
"""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gputrace.tracer import estimator as est  # noqa: E402


def rows(run: Path) -> list[str]:
    out = []
    for job in json.loads((run / "summary.json").read_text()):
        d = json.loads((run / f"{job}.json").read_text())
        per = d["exact"]["calls_per_step"]
        by: dict[float, dict] = {}
        for p in d["tracer_pairs"]:
            steps = p["session_steps_per_s"] or p["untraced_steps_per_s"]
            obs, _ = est.load_observations(json.loads(lzma.open(run / (p["attach_file"][:-5] + ".obs.json.xz")).read()))
            b = by.setdefault(p["attach_s"], {"n": 0, "ok": 0, "cov": 0, "worst": 0.0, "cost": [], "half": []})
            for name, (r, e) in p["rates"].items():
                true = per.get(name, 0) * steps
                if true < 1000:
                    continue
                b["n"] += 1
                b["ok"] += abs(r / true - 1) <= 0.1
                b["cov"] += abs(r - true) <= e
                b["worst"] = max(b["worst"], abs(r / true - 1))
                b["half"].append(e / true)
            b["cost"].append((p["slowdown_local"], p.get("slowdown_steps"), p["accounted"],
                              sum(1 for o in obs for w in o.windows if w.steps)))
        for length, b in by.items():
            half = sorted(b["half"])[len(b["half"]) // 2] if b["half"] else float("nan")
            costs = ", ".join(f"{100 * a:.2f}/{'-' if w is None else f'{100 * w:.2f}'}/{100 * c:.2f} ({n})"
                              for a, w, c, n in b["cost"])
            out.append(f"| {run.name} | {job} | {length:.0f} s | {b['ok']} / {b['cov']} / {b['n']}; "
                       f"{100 * b['worst']:.1f}%; ±{100 * half:.0f}% | {costs} |")
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print("\n".join(rows(Path(arg))))
