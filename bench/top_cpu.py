"""`gputrace top`'s own CPU use at the default refresh with N traced processes (default 50).

Starts N simcuda workloads (launch_bound, mostly waiting on 20 ms kernels, about 1% of a CPU each), then,
--runs times over the same workloads:
  1. `gputrace top` in a tmux pane (a real terminal, the real UI), waits until its header shows all N
     processes measured and none attaching, then reads its CPU time (/proc/PID/stat) over --measure seconds;
     then sends `q` and times how long the process takes to end (until it is a zombie: tmux reaps a
     pane's command a second or two later, whatever the command);
  2. `gputrace record` (the same live source without the UI) over the same span, which also gives the
     tracer's in-target probe cost from the frames it writes (reported separately: uprobes run in the
     traced processes, not in top).
Other CUDA processes on the host (another user's tests, say) are traced by top too, each new libcuda
file with a program compiled for it: the ones seen while measuring are listed with each run.
Needs root and tmux. Results: bench/results/top-cpu-<tag>.json and .md.

    sudo .venv/bin/python bench/top_cpu.py --procs 50 --measure 60 --runs 3 --tag vm
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
from gputrace.tracer.targets import cuda_processes  # noqa: E402

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


def foreign(ours: set[int], seen: dict[int, str]) -> None:
    """Adds the CUDA processes on the host that are not ours to `seen` (pid -> libcuda path)."""
    for pid, lib in cuda_processes().items():
        if pid not in ours:
            seen.setdefault(pid, lib.path)


def measure(pid: int, seconds: float, ours: set[int]) -> dict:
    """CPU over `seconds`: the whole process, its main thread (top's UI event loop; record's writer)
    and its other threads (the live source: discovery and the tracer's host sessions), user and
    system (attaching and detaching probes is system time) apart; and the CUDA processes not ours
    seen meanwhile (looked for every 10 s, by this process)."""
    seen: dict[int, str] = {}
    c0, th0, t0 = cpu_s(pid), thread_times(pid), time.monotonic()
    while True:
        foreign(ours, seen)
        left = t0 + seconds - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(10.0, left))
    c1, th1, t1 = cpu_s(pid), thread_times(pid), time.monotonic()
    wall = t1 - t0

    def share(tids, i):
        return sum(th1[t][i] - th0.get(t, (0.0, 0.0))[i] for t in tids) / wall

    main, others = [t for t in th1 if t == pid], [t for t in th1 if t != pid]
    return {"cpu_s": c1 - c0, "wall_s": wall, "cpu_share_of_one_core": (c1 - c0) / wall, "rss_mib": rss_mib(pid),
            "main_thread": {"user": share(main, 0), "system": share(main, 1)},
            "other_threads": {"user": share(others, 0), "system": share(others, 1)},
            "foreign_cuda_processes": [{"pid": p, "library": lib} for p, lib in sorted(seen.items())]}


def time_quit(session: str, pid: int, timeout: float = 30.0) -> float:
    """Sends `q` to top's pane; seconds until its process has ended (a zombie, or reaped)."""
    t0 = time.monotonic()
    subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
    while time.monotonic() - t0 < timeout:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
        except OSError:
            break
        time.sleep(0.002)
    return time.monotonic() - t0


def wait_ui_ready(session: str, n: int, pids: set[int], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
        shown = {int(m) for m in re.findall(r"^\s*(\d+)\s+launch_bound", screen, re.M)}
        if "attaching" not in screen and len(shown & pids) >= min(n, 40):  # the pane shows about 40 rows
            return time.monotonic() - t0
        time.sleep(1)
    raise SystemExit(f"top did not show the {n} processes within {timeout} s:\n{screen}")


def one_run(args, pids: set[int]) -> dict:
    session = f"gtbench{os.getpid()}"
    run: dict = {}
    try:
        subprocess.run(["tmux", "new", "-d", "-s", session, "-x", "200", "-y", "60",
                        f"exec {sys.executable} -m gputrace top"], check=True, cwd=ROOT)
        top_pid = int(subprocess.run(["tmux", "display", "-p", "-t", session, "#{pane_pid}"],
                                     capture_output=True, text=True, check=True).stdout)
        run["top_warmup_s"] = wait_ui_ready(session, args.procs, pids, args.warmup_timeout)
        run["top"] = measure(top_pid, args.measure, pids)
        run["top_quit_s"] = time_quit(session, top_pid)
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
            run["record_warmup_s"] = time.monotonic() - t0
            skip = len(out.read_bytes().splitlines())
            run["record"] = measure(rec.pid, args.measure, pids)
            rec.terminate()
            rec.wait()
            frames = [orjson.loads(x) for x in out.read_bytes().splitlines()[skip:]]
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    cost = sum(r["snapshot"]["tracer_cost_s"] for f in frames for r in f["processes"] if r["pid"] in pids)
    span = sum(r["snapshot"]["interval_s"] for f in frames for r in f["processes"] if r["pid"] in pids)
    tcpu = sum(r["snapshot"]["target_cpu_s"] or 0 for f in frames for r in f["processes"] if r["pid"] in pids)
    run["tracer_in_targets"] = {
        "probe_cpu_s_per_s_all_targets": cost / (span / args.procs) if span else None,
        "share_of_targets_cpu": cost / tcpu if tcpu else None,
        "frames": len(frames),
        "processes_with_calls": len({r["pid"] for f in frames for r in f["processes"]
                                     if r["pid"] in pids and r["snapshot"]["calls_hz"] > 0}),
    }
    return run


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=50)
    ap.add_argument("--measure", type=float, default=30.0)
    ap.add_argument("--runs", type=int, default=1, help="times to measure top and record, over the same workloads")
    ap.add_argument("--warmup-timeout", type=float, default=600.0)
    ap.add_argument("--tag", default="vm")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("tmux"):
        raise SystemExit("needs root and tmux")
    env = simcuda.env()
    argv = simcuda.workload("launch_bound") + ["--seconds", "3600", *KNOBS]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(args.procs)]
    pids = {p.pid for p in procs}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "tracer", "tui", "gputrace", "bpf"],
                                capture_output=True, text=True, cwd=ROOT).stdout.strip())
    result: dict = {"procs": args.procs, "refresh_s": 1.0, "budget": 0.01, "measure_s": args.measure,
                    "workload": " ".join(["launch_bound", *KNOBS]), "host": os.uname().nodename,
                    "cpus": os.cpu_count(), "command": " ".join(sys.argv),
                    "commit": commit + (" (with uncommitted changes)" if dirty else ""), "runs": []}
    try:
        for _ in range(args.runs):
            result["runs"].append(one_run(args, pids))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    res = ROOT / "bench" / "results"
    (res / f"top-cpu-{args.tag}.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    rows = []
    for i, r in enumerate(result["runs"], 1):
        t, k = r["top"], r["tracer_in_targets"]
        probe = k["probe_cpu_s_per_s_all_targets"]
        others = len(t["foreign_cuda_processes"]) + len(r["record"]["foreign_cuda_processes"])
        rows.append(f"| {i} | {pct(t['cpu_share_of_one_core'])} | {pct(t['main_thread']['user'])} + "
                    f"{pct(t['main_thread']['system'])} | {pct(t['other_threads']['user'])} + "
                    f"{pct(t['other_threads']['system'])} | {r['top_quit_s']:.2f} s | "
                    f"{pct(r['record']['cpu_share_of_one_core'])} | "
                    f"{probe * 1e3 if probe is not None else float('nan'):.2f} ms/s | {others} |")
    last = result["runs"][-1]
    t, k = last["top"], last["tracer_in_targets"]
    md = f"""# `gputrace top`: its own CPU use with {args.procs} traced processes ({args.tag})

Command: `{result['command']}` (as root), on {result['host']} ({result['cpus']} CPUs), at {result['commit']}.
Workloads: {args.procs} x `{result['workload']}`; top at its defaults (refresh 1 s, budget 1%).
Each run: `gputrace top` in a 200x60 tmux pane, measured over {args.measure:.0f} s once every process is on
screen, then `q`; then `gputrace record` (the same live source, no UI) over {args.measure:.0f} s.

| run | `top` (share of one core) | UI thread (user + sys) | other threads (user + sys) | `q` until the process ended | `record` | probe cost in the targets | other CUDA processes seen |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Other threads: discovery and the host session that attaches, detaches and reads the maps. The probe
cost is the uprobes' time in the {args.procs} traced processes (charged to them, not to top), from
record's frames; the last run: {100 * (k['share_of_targets_cpu'] or 0):.2f}% of their CPU time,
{k['processes_with_calls']} of the {args.procs} with calls measured. RSS: top {t['rss_mib']:.0f} MiB, record
{last['record']['rss_mib']:.0f} MiB. Warm-up (until every process is measured): top {last['top_warmup_s']:.0f} s,
record {last['record_warmup_s']:.0f} s.
"""
    (res / f"top-cpu-{args.tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
