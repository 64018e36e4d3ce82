#!/usr/bin/env python3
"""The shim's cost on the simulated driver: ns added per intercepted call, and a launch-bound loop.

1. bench/shim_bench.c under the shim: each case's call timed through the driver's own entry point
   and through the shim's wrapper in alternating blocks (order flipped every round), one process;
   added = wrapper - driver per round, median and p10/p90 reported.  `not_wrapped` is the noise floor.
   bench/shim_registry_bench.c: the registry alone (record + remove, and a lookup that misses) from
   1, 2, 4 and 8 threads at once: what a state call adds beyond the gate.
2. simcuda's launch_bound workload (the H200 PyTorch step's driver-call mix) with and without the
   shim, as paired runs in alternating order; slowdown = 1 - shimmed/plain steps/s per pair, and the
   prediction from (1): gated calls per step x added ns / step time.

Run:  .venv/bin/python bench/shim_sim.py --out bench/results/shim-sim.json   (add --loop for part 2; on a
      small VM the loop's run-to-run noise is far larger than the shim's effect)
Writes the JSON and a short Markdown summary beside it (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout

from gputrace import shim, simcuda  # noqa: E402
from gputrace.base.native import build  # noqa: E402

sys.path.insert(0, str(HERE))
from tables import served_async_rows, shim_cost_rows  # noqa: E402

# launch_bound's calls per step that the shim gates (everything else passes through untouched).
GATED_PER_STEP = {"cuLaunchKernel": 21, "cuLaunchKernelEx": 14, "cuMemcpyDtoDAsync_v2": 1}


def microbench(rounds: int, calls: int, sock_dir: str) -> dict:
    exe = build("shim_bench", [HERE / "shim_bench.c"], ldflags=["-ldl"])
    env = shim.preload_env(simcuda.env())
    env.update(SIMCUDA_LAUNCH_NS="0", SIMCUDA_KERNEL_NS="0", GPUTRACE_SHIM_DIR=sock_dir)
    out = subprocess.run([str(exe), "--rounds", str(rounds), "--calls", str(calls)], env=env, check=True,
                         capture_output=True, text=True).stdout
    d = json.loads(out)
    # The stream-ordered pair again with the shim serving it through the VMM API (--suspendable).
    served = subprocess.run([str(exe), "--rounds", str(rounds), "--calls", str(calls), "--only", "alloc_free_async"],
                            env={**env, "GPUTRACE_SHIM_VMM": "1"}, check=True, capture_output=True, text=True).stdout
    d["served_through_vmm"] = json.loads(served)["cases"]["alloc_free_async"]
    return d


def registry_bench() -> dict:
    root = HERE.parent
    exe = build("shim_registry_bench", [HERE / "shim_registry_bench.c", root / "shim" / "registry.c"],
                cflags=[f"-I{root / 'shim'}", f"-I{root / 'simcuda'}", "-pthread"], ldflags=["-pthread"],
                headers=[root / "shim" / "shim_int.h", root / "shim" / "shim_api.h", root / "simcuda" / "cuda.h"])
    return json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)


def loop_pairs(pairs: int, seconds: float, launch_ns: int, sock_dir: str) -> dict:
    plain = simcuda.env()
    shimmed = shim.preload_env(plain)
    shimmed["GPUTRACE_SHIM_DIR"] = sock_dir
    argv = simcuda.workload("launch_bound") + ["--seconds", str(seconds), "--launch-ns", str(launch_ns),
                                               "--kernel-ns", "0"]

    def rate(env: dict) -> float:
        r = json.loads(subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout)
        assert r["check"] == "ok"
        return r["steps"] / r["elapsed_s"]

    rows = []
    for i in range(pairs):
        if i % 2:
            s = rate(shimmed)
            p = rate(plain)
        else:
            p = rate(plain)
            s = rate(shimmed)
        rows.append({"plain_steps_per_s": p, "shim_steps_per_s": s, "slowdown": 1 - s / p})
    slow = [r["slowdown"] for r in rows]
    return {
        "launch_ns": launch_ns, "seconds_per_run": seconds, "pairs": rows,
        "plain_steps_per_s_median": statistics.median(r["plain_steps_per_s"] for r in rows),
        "shim_steps_per_s_median": statistics.median(r["shim_steps_per_s"] for r in rows),
        "slowdown_median": statistics.median(slow), "slowdown_min": min(slow), "slowdown_max": max(slow),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--loop", action="store_true",
                    help="also run the launch_bound loop paired with and without the shim (noisy on small VMs)")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "shim-sim.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        sock_dir = os.path.join(td, "rt")
        os.mkdir(sock_dir, 0o700)
        t0 = time.time()
        micro = microbench(a.rounds, a.calls, sock_dir)
        added = micro["cases"]["launch_invalid"]["added_ns_median"]
        registry = registry_bench()
        loops = [loop_pairs(a.pairs, a.seconds, ns, sock_dir) for ns in (0, 6000)] if a.loop else []
    for lp in loops:
        step_s = 1 / lp["plain_steps_per_s_median"]
        lp["predicted_slowdown_max"] = sum(GATED_PER_STEP.values()) * added * 1e-9 / step_s
    doc = {
        "schema": 1, "bench": "shim-sim", "driver": "simcuda",
        "command": " ".join([".venv/bin/python", "bench/shim_sim.py"] + sys.argv[1:]),
        "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count(),
                 "python": platform.python_version()},
        "duration_s": round(time.time() - t0, 1),
        "per_call": micro, "registry": registry, "launch_bound": loops,
        "gated_calls_per_step": GATED_PER_STEP,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    a.out.with_suffix(".md").write_text(summary(doc))
    print(summary(doc))
    return 0


def summary(d: dict) -> str:
    c = d["per_call"]["cases"]
    lines = [
        "# The shim on simcuda: added cost per intercepted call",
        "",
        f"Command: `{d['command']}` ({d['host']['machine']}, kernel {d['host']['kernel']}, {d['host']['cpus']} CPUs).",
        f"Paired, interleaved blocks in one process ({d['per_call']['rounds']} rounds); ns per call, medians.",
        "",
        *shim_cost_rows(c),
        *served_async_rows(d["per_call"]),
    ]
    lines += [
        "",
        "`launch_invalid` isolates the shim's gated path (the driver rejects the call at once); `launch` and",
        "`event_record` are real submissions, whose own cost and jitter on simcuda dwarf the difference;",
        "`free_invalid` is a state call's path, which adds a registry lookup (shard spinlock and hash) to the gate.",
        "",
        "## The registry alone (bench/shim_registry_bench.c), ns per operation per thread",
        "",
        "| threads | record + remove | lookup miss |",
        "|---:|---:|---:|",
    ]
    for t in d["registry"]["threads"]:
        lines.append(f"| {t['threads']} | {t['put_take_pair_ns']:.1f} | {t['lookup_miss_ns']:.1f} |")
    lines += ["", f"({d['host']['cpus']} CPUs here: more threads than CPUs measure time slices as much as the registry.)", ""]
    if not d["launch_bound"]:
        return "\n".join(lines + [""])
    lines += [
        "## launch_bound (the H200 PyTorch step's call mix), paired runs in alternating order",
        "",
        "| CPU cost per launch | plain steps/s | shim steps/s | slowdown median (min..max) | predicted max |",
        "|---:|---:|---:|---:|---:|",
    ]
    for lp in d["launch_bound"]:
        lines.append(f"| {lp['launch_ns']} ns | {lp['plain_steps_per_s_median']:.0f} | {lp['shim_steps_per_s_median']:.0f} | "
                     f"{lp['slowdown_median']:+.2%} ({lp['slowdown_min']:+.2%}..{lp['slowdown_max']:+.2%}) | "
                     f"{lp['predicted_slowdown_max']:.3%} |")
    lines += ["", "Predicted max: gated calls per step x added ns (launch_invalid) / plain step time.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
