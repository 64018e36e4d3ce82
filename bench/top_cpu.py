"""`gputrace top`'s own CPU use at the default refresh with N traced processes (default 50).

Starts N simcuda workloads (launch_bound, mostly waiting on 20 ms kernels, about 1% of a CPU each), then:
  1. `gputrace top` in a tmux pane (a real terminal, the real UI), waits until its header shows all N
     processes measured and none attaching, then reads its CPU time (/proc/PID/stat) over --measure seconds;
  2. `gputrace record` (the same live source without the UI) over the same span, which also gives the
     tracer's in-target probe cost from the frames it writes (reported separately: uprobes run in the
     traced processes, not in top).
Needs root and tmux. Results: bench/results/top-cpu-<tag>.json and .md.

    sudo .venv/bin/python bench/top_cpu.py --procs 50 --measure 30 --tag vm
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gputrace import simcuda  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")
KNOBS = ["--scale", "0.05", "--launch-ns", "50000", "--kernel-ns", "20000000"]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TCK


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def thread_times(pid: int) -> dict[int, tuple[float, float]]:
    """tid -> (user s, system s) of every thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) / TCK, int(fields[12]) / TCK)
    return out


def measure(pid: int, seconds: float) -> dict:
    """CPU over `seconds`: the whole process, its main thread (top's UI event loop; record's writer)
    and its other threads (the live source: discovery and the tracer's host sessions), user and
    system (attaching and detaching probes is system time) apart."""
    c0, th0, t0 = cpu_s(pid), thread_times(pid), time.monotonic()
    time.sleep(seconds)
    c1, th1, t1 = cpu_s(pid), thread_times(pid), time.monotonic()
    wall = t1 - t0

    def share(tids, i):
        return sum(th1[t][i] - th0.get(t, (0.0, 0.0))[i] for t in tids) / wall

    main, others = [t for t in th1 if t == pid], [t for t in th1 if t != pid]
    return {"cpu_s": c1 - c0, "wall_s": wall, "cpu_share_of_one_core": (c1 - c0) / wall, "rss_mib": rss_mib(pid),
            "main_thread": {"user": share(main, 0), "system": share(main, 1)},
            "other_threads": {"user": share(others, 0), "system": share(others, 1)}}


def wait_ui_ready(session: str, n: int, pids: set[int], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
        shown = {int(m) for m in re.findall(r"^\s*(\d+)\s+launch_bound", screen, re.M)}
        if "attaching" not in screen and len(shown & pids) >= min(n, 40):  # the pane shows about 40 rows
            return time.monotonic() - t0
        time.sleep(1)
    raise SystemExit(f"top did not show the {n} processes within {timeout} s:\n{screen}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=50)
    ap.add_argument("--measure", type=float, default=30.0)
    ap.add_argument("--warmup-timeout", type=float, default=600.0)
    ap.add_argument("--tag", default="vm")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("tmux"):
        raise SystemExit("needs root and tmux")
    env = simcuda.env()
    argv = simcuda.workload("launch_bound") + ["--seconds", "3600", *KNOBS]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(args.procs)]
    pids = {p.pid for p in procs}
    session = f"gtbench{os.getpid()}"
    result: dict = {"procs": args.procs, "refresh_s": 1.0, "budget": 0.01, "measure_s": args.measure,
                    "workload": " ".join(["launch_bound", *KNOBS]), "host": os.uname().nodename,
                    "cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    try:
        subprocess.run(["tmux", "new", "-d", "-s", session, "-x", "200", "-y", "60",
                        f"exec {sys.executable} -m gputrace top"], check=True, cwd=ROOT)
        top_pid = int(subprocess.run(["tmux", "display", "-p", "-t", session, "#{pane_pid}"],
                                     capture_output=True, text=True, check=True).stdout)
        result["top_warmup_s"] = wait_ui_ready(session, args.procs, pids, args.warmup_timeout)
        result["top"] = measure(top_pid, args.measure)
        subprocess.run(["tmux", "send-keys", "-t", session, "q"])
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rec.jsonl"
            rec = subprocess.Popen([sys.executable, "-m", "gputrace", "record", "-o", str(out)], cwd=ROOT,
                                   stderr=subprocess.DEVNULL)
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.warmup_timeout:  # warm: the last frame has every pid, none pending
                lines = out.read_bytes().splitlines() if out.exists() else []
                if len(lines) > 1:
                    last = orjson.loads(lines[-1])
                    if not last["pending"] and pids <= {r["pid"] for r in last["processes"]}:
                        break
                time.sleep(1)
            result["record_warmup_s"] = time.monotonic() - t0
            skip = len(out.read_bytes().splitlines())
            result["record"] = measure(rec.pid, args.measure)
            rec.terminate()
            rec.wait()
            frames = [orjson.loads(x) for x in out.read_bytes().splitlines()[skip:]]
        cost = sum(r["snapshot"]["tracer_cost_s"] for f in frames for r in f["processes"] if r["pid"] in pids)
        span = sum(r["snapshot"]["interval_s"] for f in frames for r in f["processes"] if r["pid"] in pids)
        tcpu = sum(r["snapshot"]["target_cpu_s"] or 0 for f in frames for r in f["processes"] if r["pid"] in pids)
        result["tracer_in_targets"] = {
            "probe_cpu_s_per_s_all_targets": cost / (span / args.procs) if span else None,
            "share_of_targets_cpu": cost / tcpu if tcpu else None,
            "frames": len(frames),
            "processes_with_calls": len({r["pid"] for f in frames for r in f["processes"]
                                         if r["pid"] in pids and r["snapshot"]["calls_hz"] > 0}),
        }
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        for p in procs:
            p.kill()
            p.wait()
    res = ROOT / "bench" / "results"
    (res / f"top-cpu-{args.tag}.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    t, r, k = result["top"], result["record"], result["tracer_in_targets"]
    md = f"""# `gputrace top`: its own CPU use with {args.procs} traced processes ({args.tag})

Command: `{result['command']}` (as root), on {result['host']} ({result['cpus']} CPUs).
Workloads: {args.procs} x `{result['workload']}`; top at its defaults (refresh 1 s, budget 1%).

| what | CPU (share of one core) | RSS |
|---|---|---|
| `gputrace top` (Textual UI in tmux), over {t['wall_s']:.0f} s | {100 * t['cpu_share_of_one_core']:.1f}% | {t['rss_mib']:.0f} MiB |
| `gputrace record` (same live source, no UI), over {r['wall_s']:.0f} s | {100 * r['cpu_share_of_one_core']:.1f}% | {r['rss_mib']:.0f} MiB |

Where top's share goes (user + system, share of one core): main thread (the Textual UI) {100 * t['main_thread']['user']:.1f}% + {100 * t['main_thread']['system']:.1f}%;
other threads (discovery, the host session that attaches, detaches and reads the maps) {100 * t['other_threads']['user']:.1f}% + {100 * t['other_threads']['system']:.1f}%.

Warm-up (until every process is measured): top {result['top_warmup_s']:.0f} s, record {result['record_warmup_s']:.0f} s.
Tracer's in-target cost (uprobe hits, charged to the traced processes, not to top): {k['probe_cpu_s_per_s_all_targets'] * 1e3 if k['probe_cpu_s_per_s_all_targets'] is not None else float('nan'):.2f} ms of CPU per second over all {args.procs},
{100 * (k['share_of_targets_cpu'] or 0):.2f}% of their CPU time; {k['processes_with_calls']} of the {args.procs} had calls measured in the record span.
"""
    (res / f"top-cpu-{args.tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
