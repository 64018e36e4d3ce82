#!/usr/bin/env python3
"""Offline check of one idea for the 5-s rates: scale each interval's windows by the job's pace, as a
once-a-step function counted exactly on the watch link gives it, before estimating.

    .venv/bin/python bench/audit_pace_offline.py bench/results/audit-h200-9/run16 gpt2 [MIN_HZ]

Reads a bench/audit_gpu.py run's saved observations (`*.obs.json`, or `.obs.json.xz`), and for each
attach prints every function above 1k calls/s against the truth, by the estimator as it is and with
the pace applied; then the counts (pairs, within +-10%, inside the stated interval) of both. The pace
function: one on the watch link in every interval after the scout, at least MIN_HZ (20) a second, the
most called such. Result (bench/results/audit-h200.md, ninth round): no gain.
"""

from __future__ import annotations

import dataclasses
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gputrace.tracer import estimator as est  # noqa: E402


def read(path: Path) -> dict:
    xz = path.with_name(path.name + ".xz")
    return json.loads(path.read_text() if path.exists() else lzma.open(xz).read())


def pace_of(obs: list[est.Observation], min_hz: float) -> tuple[int, list[float | None]] | None:
    """(function, its rate in each interval) of the pace function, or None where none qualifies."""
    best = None
    for g in set().union(*[o.watched_calls for o in obs]):
        rates: list[float | None] = []
        for o in obs:
            t = o.span_s - o.unwatched_s.get(g, 0.0)
            c = o.watched_calls.get(g, 0)
            rates.append(c / t if t > 0.3 * o.span_s and c >= min_hz * t else None)
        if any(r is None for r in rates[1:]):
            continue
        total = sum(o.watched_calls.get(g, 0) for o in obs)
        if best is None or total > best[0]:
            best = (total, g, rates)
    return None if best is None else (best[1], best[2])


def paced(obs: list[est.Observation], rates: list[float | None]) -> list[est.Observation]:
    """Each interval's times in 'pace seconds': scaled by its pace over the attach's mean pace."""
    known = [(o, r) for o, r in zip(obs, rates) if r is not None]
    mean = sum(r * o.span_s for o, r in known) / sum(o.span_s for o, _ in known)
    out = []
    for o, r in zip(obs, rates):
        s = r / mean if r is not None else 1.0
        ws = tuple(dataclasses.replace(w, counted_s=w.counted_s * s, probe_s=w.probe_s * s, stepped_s=w.stepped_s * s)
                   for w in o.windows)
        out.append(est.Observation(o.span_s * s, ws, o.watched_calls, {f: u * s for f, u in o.unwatched_s.items()}))
    return out


def main() -> int:
    d, job = Path(sys.argv[1]), sys.argv[2]
    min_hz = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    doc = json.loads((d / f"{job}.json").read_text())
    per_step = doc["exact"]["calls_per_step"]
    tally = {"as is": [0, 0, 0], "paced": [0, 0, 0]}
    for p in doc["tracer_pairs"]:
        o = read(d / (p["attach_file"][:-5] + ".obs.json"))
        obs, expo = est.load_observations(o)
        names = o["functions"]
        steps = p["session_steps_per_s"] or p["untraced_steps_per_s"]
        pace = pace_of(obs, min_hz)
        plain = est.estimate(obs, expo)
        span = sum(x.span_s for x in obs)
        alt = est.estimate(paced(obs, pace[1]), expo) if pace else None
        print(f"== {p['attach_file']}: pace {names[str(pace[0])] if pace else None}")
        for f, e in plain.items():
            name = names[str(f)]
            true = per_step.get(name, 0) * steps
            if true < 1000:
                continue
            row = [("as is", e.rate_hz / true - 1, e.err_hz / true)]
            if alt:
                a = alt[f]
                rate = a.calls_estimated / span
                row.append(("paced", rate / true - 1, rate * a.err_hz / a.rate_hz / true if a.rate_hz else 0.0))
            else:
                row.append(("paced",) + row[0][1:])
            for k, err, half in row:
                tally[k][0] += 1
                tally[k][1] += abs(err) <= 0.10
                tally[k][2] += abs(err) <= half
            print(f"   {name[:36]:36s} " + "  ".join(f"{k} {err:+.3f} +-{half:.2f}" for k, err, half in row))
    print(f"{job}: (pairs, within 10%, covered) {tally}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
