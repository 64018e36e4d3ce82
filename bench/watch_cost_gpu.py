#!/usr/bin/env python3
"""Does the watch link cost a job anything while none of its breakpoints is hit?

The tracer keeps an entry probe on every function it has not seen called (~670 on a real libcuda),
for the whole attach. Not hit, a breakpoint costs nothing on the job's path, unless putting it
there changed how the job's code is mapped: a breakpoint is written into a private copy of its
page, and a libcuda text mapped by 2 MiB folios would be split into 4 KiB pages (more iTLB misses
on the job's hot driver code). This measures, on one warm job (bench/gpu_jobs.py):
  1. libcuda's text mapping in the job (/proc/PID/smaps: FilePmdMapped, Anonymous, Private_Dirty)
     before, with the watch link attached, and after it is closed;
  2. the job's speed with the watch link attached (counting closed), each phase between two
     without it (U W U W ... U);
  3. the same with `gputrace attach -p PID -d 10` (the whole tracer), keeping the traced phases'
     step times, so where in the attach the job slowed can be read off.

Run (root, real GPU, after `source bench/gpu-env.sh`):
    python3 bench/watch_cost_gpu.py --out $OUT/watch.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from audit_gpu import Job, median_ci  # noqa: E402


def libcuda_smaps(pid: int) -> dict:
    """Summed smaps fields of the job's libcuda mappings."""
    out: dict = {}
    cur = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5:
            cur = len(parts) >= 6 and "libcuda" in parts[-1]
            continue
        if cur and parts and parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
            out[parts[0][:-1]] = out.get(parts[0][:-1], 0) + int(parts[1])
    return {k: out.get(k, 0) for k in ("Rss", "Private_Dirty", "Anonymous", "FilePmdMapped", "Shared_Clean")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--job", default="mlp")
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--phase-s", type=float, default=3.0)
    ap.add_argument("--attaches", type=int, default=3)
    args = ap.parse_args()
    from gputrace.tracer.bpfprog import COOKIE_WATCH
    from gputrace.tracer.session import open_program
    from gputrace.tracer.symbols import read_functions
    from gputrace.tracer.targets import libcuda_of

    prog, cal = open_program("auto", lambda m: print("warn:", m, file=sys.stderr))
    job = Job(args.job)
    lib = libcuda_of(job.pid).path
    funcs = read_functions(lib)
    doc: dict = {"job": args.job, "smaps_before": libcuda_smaps(job.pid)}
    # The functions the job calls are left off, as the tracer leaves them off its watch link.
    prog.next_generation()
    probe = prog.attach(lib, [f.offset for f in funcs], list(range(len(funcs))), retprobe=False, pid=job.pid)
    prog.open()
    job.run(1.0)
    prog.close_counting()
    probe.close()
    called = {f for (tgid, f), st in prog.read_stats().items() if tgid == job.pid and st.calls}
    watch = [i for i in range(len(funcs)) if i not in called]
    doc["watched"] = len(watch)

    def attach_watch():
        return prog.attach(lib, [funcs[i].offset for i in watch], [i | COOKIE_WATCH for i in watch],
                           retprobe=False, pid=job.pid)

    link = attach_watch()
    doc["smaps_watched"] = libcuda_smaps(job.pid)
    link.close()
    doc["smaps_after"] = libcuda_smaps(job.pid)
    print("smaps", doc["smaps_before"], doc["smaps_watched"], doc["smaps_after"], flush=True)

    slows = []
    prev = job.run(args.phase_s)
    for _ in range(args.cycles):
        link = attach_watch()
        w = job.run(args.phase_s)
        link.close()
        nxt = job.run(args.phase_s)
        slows.append(((prev["steps_per_s"] + nxt["steps_per_s"]) / 2) / w["steps_per_s"] - 1)
        prev = nxt
    doc["watch_slowdowns"] = slows
    doc["watch_slowdown"] = median_ci(slows)
    print("watch link:", doc["watch_slowdown"], flush=True)

    rows = []
    prev = job.run(7.0)
    for k in range(args.attaches):
        out = Path(args.out).with_name(f"watch-attach-{k}.json")
        cli = subprocess.Popen(["gputrace", "attach", "-p", str(job.pid), "-d", "10", "--json", "-q", "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t = job.run(14.0, stamps=True)
        cli.wait()
        nxt = job.run(7.0)
        ref = (prev["steps_per_s"] + nxt["steps_per_s"]) / 2
        rep = orjson.loads(out.read_bytes())
        start = rep["attach"]["started_monotonic_s"]
        # The job's rate second by second against the reference, from the attach's start.
        per_s = []
        for j in range(-3, 12):
            a = start + j
            n = sum(a <= x < a + 1 for x in t["stamps"])
            per_s.append(round(n / ref - 1, 4) if t["t0"] <= a and a + 1 <= t["t0"] + t["seconds"] else None)
        rows.append({"reference_steps_per_s": ref, "traced_steps_per_s": t["steps_per_s"],
                     "slowdown": ref / t["steps_per_s"] - 1, "rate_vs_reference_by_second_from_start": per_s,
                     "accounted": rep["summary"]["tracer_overhead"]})
        print(f"attach #{k}: slowdown {100 * rows[-1]['slowdown']:.2f}% by second {per_s}", flush=True)
        prev = nxt
    doc["attaches"] = rows
    job.close()
    prog.close()
    Path(args.out).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print("attach slowdown median", statistics.median(r["slowdown"] for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
