"""A step's length under a window's probes, from committed H200 attaches (offline).

1. `steps DIR...`: every step window the saved observations hold, per job: its probes (functions),
   its time a step and the probes' share of it, against the job's untraced step (1 / its steps a
   second while attached); the whole-step windows of every hot function are the ones with the most
   functions probed.
2. `plan REPORT`: the budget's policy driven with one attach's figures (its rates, calibrated costs
   and measured exposures; its kept step function), as tests/test_tracer_units.py does: the window
   cost c the policy prices a whole step of every probed function at, the step's planned length
   under (1 + c) and under the 1 / (1 - c) planned before 818e794, and what one whole-step window
   needs against what WHOLE_STEP_MAX_EVERY intervals' budget pays for.

    .venv/bin/python bench/audit_step_offline.py steps bench/results/audit-h200-11/run2{2,3,4}
    .venv/bin/python bench/audit_step_offline.py plan bench/results/audit-h200-11/run24/gpt2-attach-5-2.json.xz \\
        --step cuMemcpyDtoHAsync_v2 --irregular cuKernelSetAttribute --every 5
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_gpu import read_json  # noqa: E402  (bench/, beside this file)



def steps(dirs: list[Path]) -> int:
    by_job: dict[str, list[tuple[int, float, float, float]]] = {}
    for d in dirs:
        for path in sorted(d.glob("*.json")):
            if path.name == "summary.json" or "-attach-" in path.name:
                continue
            doc = orjson.loads(path.read_bytes())
            for p in doc["tracer_pairs"]:
                obs = read_json(d / Path(p["attach_file"]).with_suffix(".obs.json"))
                hz = p.get("session_steps_per_s")
                if obs is None or not hz:
                    continue
                for o in obs["observations"]:
                    for w in o["windows"]:
                        if w.get("step") and w["step"][1] and w["counted_s"] > 0:
                            n = w["step"][1]
                            by_job.setdefault(doc["job"], []).append(
                                (len(w["probed"]), w["counted_s"] / n, w["probe_s"] / w["counted_s"], 1.0 / hz))
    for job, rows in sorted(by_job.items()):
        most = max(r[0] for r in rows)
        # (A "step" shorter than the job's own is a burst function's gap, not a step: run 23's
        # cuKernelSetAttribute, before such functions were found irregular.)
        short = [r for r in rows if r[0] == most and r[1] < 0.8 * r[3]]
        whole = [r for r in rows if r[0] == most and r[1] >= 0.8 * r[3]]
        print(f"{job}: {len(rows)} step windows, {len(whole) + len(short)} that probed {most} functions "
              f"({len(short)} shorter than the job's step left out): "
              f"{1e3 * min(r[1] for r in whole):.1f}-{1e3 * max(r[1] for r in whole):.1f} ms a step "
              f"(median {1e3 * statistics.median(r[1] for r in whole):.1f}), probes "
              f"{min(r[2] for r in whole):.2f}-{max(r[2] for r in whole):.2f} of it; untraced "
              f"{1e3 * min(r[3] for r in whole):.1f}-{1e3 * max(r[3] for r in whole):.1f} ms")
    return 0


def plan(report_path: Path, step: str, irregular: list[str], every: int | None = None) -> int:
    from gputrace.tracer.budget import STEP_ARM_S, WAITS_SHARE, WHOLE_STEP_MAX_EVERY, Policy

    every = every or WHOLE_STEP_MAX_EVERY
    from gputrace.tracer.calibrate import ProbeCost
    from gputrace.tracer.classify import FunctionClass

    rep = read_json(report_path)
    fs = [f for f in rep["summary"]["functions"] if f["rate_hz"]]
    ids = {f["name"]: i for i, f in enumerate(fs)}
    cal = rep["calibration"]["emulated"]
    cost = ProbeCost(entry_ns=cal["entry_ns"], entry_return_ns=cal["entry_return_ns"], bias_ns=cal["bias_ns"])
    classes = {i: FunctionClass(f["cls"]) for i, f in enumerate(fs)}
    p = Policy(classes, {i: cost for i in classes}, budget=rep["options"]["budget"],
               interval_s=rep["options"]["interval_s"], rng=random.Random(1),
               waiting=frozenset(i for i, f in enumerate(fs) if f["cls"] == "sync"))
    p.irregular = {ids[n] for n in irregular if n in ids}
    p.plan()  # the scout
    rates = {i: f["rate_hz"] for i, f in enumerate(fs)}
    p.observe(1, rates, {i: max(1, int(r * 0.003)) for i, r in rates.items()})
    p.observe_kept({ids[step]: rates[ids[step]]})
    # The exposures the attach measured, at their upper ends, as the tracee gives them.
    ex = rep["summary"].get("exposure")
    p.observe_exposure(ex, ex)
    probe = p.probe_set()
    timed = frozenset()
    c = p.hit_s_per_s(probe, timed)
    r = rates[ids[step]]
    new, old = (1.0 + c) / r, 1.0 / (r * (1.0 - min(c, 0.9)))
    pays = p.affordable_s(probe, timed, None, 1, every * p.every,
                          1.0 - WAITS_SHARE if probe & p.waiting else 1.0)
    print(f"{len(probe)} functions probed at {sum(rates[f] for f in probe):.0f} calls/s; c = {c:.2f}; "
          f"step {1e3 / r:.1f} ms untraced")
    for name, period in (("1 + c", new), ("1 / (1 - c)", old)):
        need = 1.1 * period + STEP_ARM_S
        print(f"  {name:12s} planned {1e3 * period:.1f} ms: a whole-step window needs {1e3 * need:.1f} ms, "
              f"{every} intervals pay for {1e3 * pays:.1f} ms: {'planned' if need <= pays else 'none'}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("steps")
    a.add_argument("dirs", nargs="+", type=Path)
    b = sub.add_parser("plan")
    b.add_argument("report", type=Path)
    b.add_argument("--step", required=True, help="the kept step function")
    b.add_argument("--irregular", action="append", default=[], help="kept functions found irregular")
    b.add_argument("--every", type=int, help="the most intervals a whole-step window is paid by "
                   "(default: WHOLE_STEP_MAX_EVERY as it is now; the twelfth round's was 5)")
    args = ap.parse_args()
    return steps(args.dirs) if args.cmd == "steps" else plan(args.report, args.step, args.irregular, args.every)


if __name__ == "__main__":
    sys.exit(main())
