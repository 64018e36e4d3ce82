"""`gputrace export`'s own CPU use with N traced processes (default 50), scraped as Prometheus would.

Starts N simcuda workloads (launch_bound, mostly waiting on 20 ms kernels, as bench/top_cpu.py does),
then `gputrace export` at its defaults (interval 1 s, budget 1%); once a scrape shows every workload
measured, reads the exporter's CPU time (/proc/PID/stat) over --measure seconds while scraping every
--scrape-s seconds (Prometheus' default is 15 s; 1 s is a harsh case), and reports the share of one
core, the scrape's latency and size, and the series count. Needs root.
Results: bench/results/exporter-cpu-<tag>.json and .md.

    sudo .venv/bin/python bench/exporter_cpu.py --procs 50 --measure 60 --scrape-s 15 --tag vm
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from top_cpu import KNOBS, measure  # noqa: E402

from gputrace import simcuda  # noqa: E402


def scrape(port: int) -> tuple[float, int, dict]:
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        body = r.read()
    took = time.monotonic() - t0
    return took, len(body), {f.name: f for f in text_string_to_metric_families(body.decode())}


def measured_pids(fams: dict) -> set[int]:
    fam = fams.get("gputrace_process_driver_calls")
    return {int(s.labels["pid"]) for s in (fam.samples if fam else ()) if s.value > 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=50)
    ap.add_argument("--measure", type=float, default=60.0)
    ap.add_argument("--scrape-s", type=float, default=15.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--warmup-timeout", type=float, default=600.0)
    ap.add_argument("--tag", default="vm")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root")
    argv = simcuda.workload("launch_bound") + ["--seconds", "3600", *KNOBS]
    procs = [subprocess.Popen(argv, env=simcuda.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(args.procs)]
    pids = {p.pid for p in procs}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "exporter", "hostview", "tracer", "gputrace",
                                 "bpf"], capture_output=True, text=True, cwd=ROOT).stdout.strip())
    result: dict = {"procs": args.procs, "interval_s": 1.0, "budget": 0.01, "measure_s": args.measure,
                    "scrape_s": args.scrape_s, "workload": " ".join(["launch_bound", *KNOBS]),
                    "host": os.uname().nodename, "cpus": os.cpu_count(), "command": " ".join(sys.argv),
                    "commit": commit + (" (with uncommitted changes)" if dirty else ""), "runs": []}
    try:
        for _ in range(args.runs):
            exp = subprocess.Popen([sys.executable, "-m", "gputrace", "export", "--listen", "127.0.0.1:0"], cwd=ROOT,
                                   stderr=subprocess.PIPE, text=True)
            try:
                port = None
                for line in exp.stderr:
                    if "serving http://" in line:
                        port = int(line.split("serving http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
                        break
                if port is None:
                    raise SystemExit("the exporter never started serving")
                t0 = time.monotonic()
                while not pids <= measured_pids(scrape(port)[2]):
                    if time.monotonic() - t0 > args.warmup_timeout:
                        raise SystemExit("not every workload was measured within the warm-up timeout")
                    time.sleep(1)
                warmup = time.monotonic() - t0
                scrapes: list[tuple[float, int, int]] = []
                stop = threading.Event()

                def scraper() -> None:
                    while not stop.wait(args.scrape_s):
                        took, size, fams = scrape(port)
                        scrapes.append((took, size, sum(len(f.samples) for f in fams.values())))

                th = threading.Thread(target=scraper, daemon=True)
                th.start()
                cpu = measure(exp.pid, args.measure, pids)
                stop.set()
                th.join()
                _, size, fams = scrape(port)
                result["runs"].append({
                    "warmup_s": warmup, "exporter": cpu, "scrapes": len(scrapes),
                    "scrape_latency_s_median": statistics.median(s[0] for s in scrapes) if scrapes else None,
                    "scrape_bytes": size, "series": sum(len(f.samples) for f in fams.values()),
                    "measured_workloads": len(pids & measured_pids(fams))})
            finally:
                exp.terminate()
                exp.wait(30)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    res = ROOT / "bench" / "results"
    (res / f"exporter-cpu-{args.tag}.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    rows = [f"| {i} | {pct(r['exporter']['cpu_share_of_one_core'])} | {pct(r['exporter']['main_thread']['user'])} + "
            f"{pct(r['exporter']['main_thread']['system'])} | {pct(r['exporter']['other_threads']['user'])} + "
            f"{pct(r['exporter']['other_threads']['system'])} | {r['scrapes']} | "
            f"{1e3 * (r['scrape_latency_s_median'] or 0):.0f} ms | {r['scrape_bytes'] / 1024:.0f} KiB | {r['series']} | "
            f"{r['measured_workloads']}/{args.procs} | {r['exporter']['rss_mib']:.0f} MiB |"
            for i, r in enumerate(result["runs"], 1)]
    md = f"""# `gputrace export`: its own CPU use with {args.procs} traced processes ({args.tag})

Command: `{result['command']}` (as root), on {result['host']} ({result['cpus']} CPUs), at {result['commit']}.
Workloads: {args.procs} x `{result['workload']}`; the exporter at its defaults (interval 1 s, budget 1%),
scraped every {args.scrape_s:g} s; measured over {args.measure:.0f} s once a scrape showed every workload measured.
The target (`top`'s): under 2% of one core.

| run | exporter (share of one core) | main thread: frames and metrics (user + sys) | other threads: tracing, HTTP (user + sys) | scrapes | scrape latency (median) | scrape size | series | workloads measured | RSS |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
"""
    (res / f"exporter-cpu-{args.tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
