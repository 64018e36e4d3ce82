#!/usr/bin/env python3
"""What the tracer's pieces cost a real job, each on its own, by paired phases within one warm process.

For each job (bench/gpu_jobs.py), after one phase traced exactly (which gives the functions it calls,
the hot set, and its calls per step), conditions alternate with untraced phases of the same length:
  cycles_cold  attach + detach of an entry link over every function the job does not call, at --hz,
               counting closed: what an attach and a detach cost the job beyond the probes that fire
  cycles_all   the same over every function, the hot ones included (their hits counted as closed)
  hot_entry    entry probes on the hot set, attached for the whole phase, counting open
  hot_timed    entry and return probes on the hot set, likewise
The slowdown of each, in job seconds, over what it did (cycles, hits) is its cost in the job, against
the calibrated figure. Then `gputrace attach -p PID -d 5 --json` runs against each job, as users run it.

Run (root, real GPU, after `source bench/gpu-env.sh`):
    python3 bench/tracer_costs_gpu.py --out $OUT/costs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson

from gputrace.tracer.bpfprog import COOKIE_STEPPED, COOKIE_TIMED
from gputrace.tracer.calibrate import probe_kind
from gputrace.tracer.session import open_program
from gputrace.tracer.symbols import read_functions
from gputrace.tracer.targets import libcuda_of

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from audit_gpu import Job  # noqa: E402


def during(job: Job, seconds: float, work) -> dict:
    """Runs `work(stop_event)` in a thread while the job runs a phase; returns the phase and work's result."""
    stop = threading.Event()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", work(stop)))
    t.start()
    ph = job.run(seconds)
    stop.set()
    t.join()
    ph["work"] = out.get("r")
    return ph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", default="mlp,gpt2")
    ap.add_argument("--phase-s", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hz", type=float, default=5.0)
    args = ap.parse_args()
    prog, cal = open_program("auto", lambda m: print("warn:", m, file=sys.stderr))
    result: dict = {"calibration": dataclasses.asdict(cal), "options": vars(args), "jobs": {}}
    print("calibration:", cal, flush=True)
    for name in args.jobs.split(","):
        job = Job(name, shim=False)
        lib = libcuda_of(job.pid).path
        funcs = read_functions(lib)
        kinds = [probe_kind(lib, f.offset) for f in funcs]
        offs = [f.offset for f in funcs]

        def cookie(i: int, timed: bool = False) -> int:
            return i | (COOKIE_TIMED if timed else 0) | (COOKIE_STEPPED if kinds[i] == "stepped" else 0)

        def rows() -> dict[int, object]:
            return {f: st for (tgid, f), st in prog.read_stats().items() if tgid == job.pid}

        # Exact phase: which functions, how often.
        prog.next_generation()
        links = [prog.attach(lib, offs, [cookie(i) for i in range(len(offs))], retprobe=False, pid=job.pid)]
        prog.open()
        before = rows()
        ph = job.run(args.phase_s)
        prog.close_counting()
        for l in links:
            l.close()
        after = rows()
        calls = {i: after[i].calls - (before[i].calls if i in before else 0) for i in after}
        calls = {i: c for i, c in calls.items() if c > 0}
        hot = sorted(calls)
        cold = [i for i in range(len(offs)) if i not in calls]
        per_step = {funcs[i].name: c / ph["steps"] for i, c in sorted(calls.items(), key=lambda kv: -kv[1])}
        jr: dict = {"exact_phase": ph, "calls_per_step": per_step, "hot": len(hot), "cold": len(cold),
                    "hot_stepped": [funcs[i].name for i in hot if kinds[i] == "stepped"], "pairs": []}
        print(name, "calls/step", {k: round(v, 1) for k, v in list(per_step.items())[:12]}, flush=True)

        def cycles(ids):
            def work(stop):
                n, closed0 = 0, sum(st.closed for st in rows().values())
                t_att = []
                while not stop.is_set():
                    t0 = time.perf_counter()
                    l = prog.attach(lib, [offs[i] for i in ids], [cookie(i) for i in ids], retprobe=False, pid=job.pid)
                    t_att.append(time.perf_counter() - t0)
                    l.close()
                    n += 1
                    stop.wait(1.0 / args.hz)
                return {"cycles": n, "closed_hits": sum(st.closed for st in rows().values()) - closed0,
                        "attach_s_median": statistics.median(t_att) if t_att else None}
            return work

        def hot_probed(timed: bool):
            def work(stop):
                prog.next_generation()
                ls = []
                if timed:
                    ls.append(prog.attach(lib, [offs[i] for i in hot], [cookie(i, True) for i in hot], retprobe=True, pid=job.pid))
                ls.append(prog.attach(lib, [offs[i] for i in hot], [cookie(i, timed) for i in hot], retprobe=False, pid=job.pid))
                b = rows()
                prog.open()
                stop.wait()
                prog.close_counting()
                a = rows()
                for l in reversed(ls):
                    l.close()
                hits = sum(a[i].calls - (b[i].calls if i in b else 0) for i in a)
                stepped = sum(a[i].calls - (b[i].calls if i in b else 0) for i in a if kinds[i] == "stepped")
                return {"hits": hits, "stepped_hits": stepped}
            return work

        conds = {"cycles_cold": cycles(cold), "cycles_all": cycles(list(range(len(offs)))),
                 "hot_entry": hot_probed(False), "hot_timed": hot_probed(True)}
        for rep in range(args.reps):
            for cname, work in conds.items():
                first_traced = rep % 2 == 1
                phases = {}
                for which in (["traced", "untraced"] if first_traced else ["untraced", "traced"]):
                    phases[which] = during(job, args.phase_s, work) if which == "traced" else job.run(args.phase_s)
                u, t = phases["untraced"], phases["traced"]
                slow = 1 - t["steps_per_s"] / u["steps_per_s"]
                # The job's lost time over the phase: what the steps it did would have taken untraced.
                lost_s = t["seconds"] - t["steps"] / u["steps_per_s"]
                w = t["work"]
                per = None
                if "cycles" in w and w["cycles"]:
                    per = {"us_per_cycle": 1e6 * lost_s / w["cycles"]}
                elif w.get("hits"):
                    per = {"ns_per_hit": 1e9 * lost_s / w["hits"]}
                row = {"cond": cname, "rep": rep, "untraced": u, "traced": t, "slowdown": slow, "lost_s": lost_s, **(per or {})}
                jr["pairs"].append(row)
                print(name, cname, rep, f"slowdown {100 * slow:.2f}%", per, w, f"cpu {t['cpu_s'] / t['seconds']:.2f}", flush=True)
        summ = {}
        for cname in conds:
            rs = [r for r in jr["pairs"] if r["cond"] == cname]
            summ[cname] = {"slowdown_median": statistics.median(r["slowdown"] for r in rs),
                           **{k: statistics.median(r[k] for r in rs) for k in ("us_per_cycle", "ns_per_hit") if k in rs[0]}}
        jr["summary"] = summ
        print(name, "summary", summ, flush=True)

        # The CLI as users run it, at the default budget, from another process.
        t = threading.Thread(target=lambda: jr.setdefault("cli_phase", job.run(9.0)))
        t.start()
        time.sleep(0.5)
        rep_path = Path(args.out).with_name(f"attach-{name}.json")
        r = subprocess.run(["gputrace", "attach", "-p", str(job.pid), "-d", "5", "--json", "-o", str(rep_path)],
                           capture_output=True, text=True)
        t.join()
        jr["cli_stderr"] = r.stderr[-3000:]
        print(r.stderr[-1500:], flush=True)
        job.close()
        result["jobs"][name] = jr
    prog.close()
    Path(args.out).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
