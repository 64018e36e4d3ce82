#!/usr/bin/env python3
"""The default (budgeted) tracer against real frameworks' jobs that are already running, checked
against --exact on the same jobs: does `attach -p` read calls where there are calls, per step as many
as --exact counts, within its stated interval?  And `top --once` over all of them at once, a job
whose calls change mid-run, and jobs that last two seconds.

Jobs (bench/framework_jobs.py, bench/framework_job.cu): PyTorch eager, with expandable_segments and
with a CUDA graph; transformers' GPT-2 from its config; JAX; CuPy; a C++ program built with
`nvcc -cudart static`.  All run at once (16 cores), each counting its steps in a shared file.

For each job: `attach -p PID -d D` (default budget), then `--exact`, then the default again. Calls per
step of each function = its rate / the job's steps per second over the traced span (read from the
counter file every 20 ms), so the slowdown under --exact does not count as a rate error. A budgeted
figure is covered when |budgeted - exact| <= its stated 95% half-width (rate_err_hz, per step) plus
the exact one's own counting noise.

Run (root, GPU, from the repository root after `source bench/gpu-env.sh`):
  python3 bench/frameworks_gpu.py --out bench/results/frameworks-h200
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
PY_JOBS = ("torch", "expseg", "graph", "gpt2", "jax", "cupy")
MIN_HZ = 200.0  # functions compared: above this exact rate


class Job:
    def __init__(self, name: str, work: Path, argv: list[str], env: dict) -> None:
        self.name = name
        self.counter = work / f"{name}.count"
        self.counter.write_bytes(b"\0" * 16)
        self.log = open(work / f"{name}.log", "w")
        self.p = subprocess.Popen(argv + [str(self.counter)] if name == "cxx" else argv + ["--counter", str(self.counter)],
                                  env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.pid = self.p.pid
        self.samples: list[tuple[float, int]] = []
        self.lock = threading.Lock()

    def wait_ready(self) -> None:
        line = self.p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{self.name} did not start: {line!r}; see its log")

    def read(self) -> tuple[int, float]:
        n, t = struct.unpack("<Qd", self.counter.read_bytes()[:16])
        return n, t

    def sample(self) -> None:
        n, _ = self.read()
        with self.lock:
            self.samples.append((time.monotonic(), n))

    def steps_per_s(self, t0: float, t1: float) -> float | None:
        with self.lock:
            pts = [(t, n) for t, n in self.samples if t0 <= t <= t1]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()


def gputrace(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["gputrace", *args], capture_output=True, text=True, timeout=timeout)


def attach(job: Job, out: Path, seconds: float, exact: bool) -> dict:
    args = ["attach", "-q", "-p", str(job.pid), "-d", str(seconds), "--json", "-o", str(out)]
    if exact:
        args.append("--exact")
    r = gputrace(*args)
    end = time.monotonic()
    if r.returncode:
        return {"error": r.stderr.strip()[-600:]}
    rep = orjson.loads(out.read_bytes())
    span = sum(iv["interval_s"] for iv in rep["intervals"])
    sps = job.steps_per_s(end - span - 0.05, end)
    funcs = {f["name"]: f for f in rep["summary"]["functions"]}
    return {"span_s": span, "steps_per_s": sps, "calls_hz": rep["summary"]["calls_hz"],
            "not_measured": rep["summary"].get("not_measured"),
            "intervals_zero": sum(1 for iv in rep["intervals"] for p in iv["processes"]
                                  if p.get("calls_hz") == 0),
            "intervals": len(rep["intervals"]),
            "functions": {n: {"rate_hz": f["rate_hz"], "err_hz": f["rate_err_hz"], "observed": f["calls_observed"]}
                          for n, f in funcs.items()}}


def compare(exact: dict, budget: dict) -> dict:
    """Per function above MIN_HZ: calls per step exact and budgeted, and whether the interval covers."""
    out = {}
    if "error" in exact or "error" in budget or not exact["steps_per_s"] or not budget["steps_per_s"]:
        return out
    for name, e in exact["functions"].items():
        if e["rate_hz"] < MIN_HZ:
            continue
        b = budget["functions"].get(name)
        e_ps = e["rate_hz"] / exact["steps_per_s"]
        if b is None:
            out[name] = {"exact_per_step": e_ps, "budget_per_step": None, "covered": False}
            continue
        b_ps = b["rate_hz"] / budget["steps_per_s"]
        err_ps = (b["err_hz"] if b["err_hz"] is not None else math.inf) / budget["steps_per_s"]
        noise = 1.96 * math.sqrt(max(e["observed"], 1)) / max(exact["span_s"], 1e-9) / exact["steps_per_s"]
        out[name] = {"exact_per_step": e_ps, "budget_per_step": b_ps, "rel": b_ps / e_ps - 1 if e_ps else None,
                     "err_per_step": err_ps, "covered": abs(b_ps - e_ps) <= err_ps + noise}
    return out


def summary_rows(doc: dict) -> list[str]:
    """One Markdown row per job: each default attach against --exact (covered, median and max
    error per step, and the median stated 95% half-width), as frameworks-h200.md shows them."""
    rows = []
    for name, j in doc["jobs"].items():
        cells = []
        for c in ("compare1", "compare2"):
            cmp = [r for r in j.get(c, {}).values() if r.get("budget_per_step") is not None]
            if not cmp:
                cells.append("not measured")
                continue
            errs = [abs(r["rel"]) for r in cmp]
            hw = [r["err_per_step"] / r["exact_per_step"] for r in cmp]
            cells.append(f"{sum(r['covered'] for r in j[c].values())}/{len(j[c])}, median "
                         f"{100 * statistics.median(errs):.0f}%, max {100 * max(errs):.0f}% "
                         f"(stated median ±{100 * statistics.median(hw):.0f}%)")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--summarize", action="store_true",
                    help="only print the per-job table of OUT/frameworks.json (no GPU needed)")
    ap.add_argument("--jobs", default="torch,expseg,graph,gpt2,jax,cupy,cxx")
    ap.add_argument("-d", "--seconds", type=float, default=5.0)
    ap.add_argument("--switch-after", type=float, default=12.0,
                    help="the switch job's eager seconds before graph replays (longer than an attach's set-up)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summarize:
        print("\n".join(summary_rows(orjson.loads((out / "frameworks.json").read_bytes()))))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    names = [n for n in args.jobs.split(",") if n]
    doc: dict = {"command": " ".join(sys.argv), "seconds": args.seconds, "jobs": {}, "started": time.time()}

    base = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cxx = None
    if "cxx" in names:
        cxx = work / "framework_job"
        r = subprocess.run(["nvcc", "-O2", "-cudart", "static", "-o", str(cxx), str(HERE / "framework_job.cu")],
                           capture_output=True, text=True)
        if r.returncode:
            doc["cxx_build"] = r.stderr[-800:]
            names.remove("cxx")
    jobs: dict[str, Job] = {}
    for n in names:
        env = dict(base)
        if n == "expseg":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        argv = [str(cxx)] if n == "cxx" else [sys.executable, str(HERE / "framework_jobs.py"), "--job", n]
        jobs[n] = Job(n, work, argv, env)
    stop = threading.Event()
    try:
        for j in jobs.values():
            j.wait_ready()
            print(f"{j.name}: ready (pid {j.pid})", flush=True)

        def sampler() -> None:
            while not stop.is_set():
                for j in jobs.values():
                    j.sample()
                time.sleep(0.02)

        threading.Thread(target=sampler, daemon=True).start()
        time.sleep(1.0)
        # top --once over every job at once: each must be listed with calls.
        r = gputrace("top", "--once", "-d", "3", "--json", timeout=180)
        top = orjson.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-600:]}
        rows = {}
        for p in top.get("processes", []):
            rows[p.get("pid")] = p
        doc["top_once"] = {n: {"listed": j.pid in rows,
                               "calls_hz": ((rows.get(j.pid) or {}).get("snapshot") or {}).get("calls_hz"),
                               "not_measured": ((rows.get(j.pid) or {}).get("snapshot") or {}).get("not_measured")}
                           for n, j in jobs.items()}
        if "error" in top:
            doc["top_once"]["error"] = top["error"]
        print("top --once:", doc["top_once"], flush=True)
        for n, j in jobs.items():
            res = {}
            for k, exact in (("budget1", False), ("exact", True), ("budget2", False)):
                res[k] = attach(j, work / f"{n}-{k}.json", args.seconds, exact)
                print(f"{n} {k}: calls/s {res[k].get('calls_hz')}, steps/s {res[k].get('steps_per_s')}, "
                      f"zero intervals {res[k].get('intervals_zero')}/{res[k].get('intervals')} "
                      f"{res[k].get('error', '')}", flush=True)
            res["compare1"] = compare(res["exact"], res["budget1"])
            res["compare2"] = compare(res["exact"], res["budget2"])
            doc["jobs"][n] = res
            (out / "frameworks.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))  # so far
    finally:
        stop.set()
        for j in jobs.values():
            j.stop()

    # A job whose calls change mid-run (eager steps, then graph replays after 4 s), attached from before.
    sw = Job("switch", work, [sys.executable, str(HERE / "framework_jobs.py"), "--job", "switch", "--switch-after",
                              str(args.switch_after)], dict(base))
    try:
        sw.wait_ready()
        rep = attach(sw, work / "switch.json", args.switch_after + 4, False)
        raw = orjson.loads((work / "switch.json").read_bytes()) if "error" not in rep else {"intervals": []}
        graph_by_iv = [next((f["rate_hz"] for p in iv["processes"] for f in p["functions"] if f["name"] == "cuGraphLaunch"),
                            0.0) for iv in raw["intervals"]]
        doc["switch"] = {"attach": rep, "cuGraphLaunch_hz_by_interval": graph_by_iv}
        print("switch: cuGraphLaunch by interval", [round(x) for x in graph_by_iv], flush=True)
    finally:
        sw.stop()

    # Jobs that last two seconds: traced from their start, and attached to just after they start.
    short = {}
    for how in ("from_start", "attach_p"):
        argv = [sys.executable, str(HERE / "framework_jobs.py"), "--job", "torch", "--seconds", "2", "--warmup", "5",
                "--counter", str(work / f"short-{how}.count")]
        o = work / f"short-{how}.json"
        if how == "from_start":
            r = subprocess.run(["gputrace", "attach", "-q", "--json", "-o", str(o), "--", *argv], capture_output=True,
                               text=True, timeout=300, env=base)
        else:
            p = subprocess.Popen(argv, env=base, stdout=subprocess.PIPE, text=True)
            p.stdout.readline()  # ready: its 2 s start now
            r = gputrace("attach", "-q", "-p", str(p.pid), "--json", "-o", str(o))
            p.wait()
        if r.returncode == 0:
            rep = orjson.loads(o.read_bytes())
            short[how] = {"calls_hz": rep["summary"]["calls_hz"], "not_measured": rep["summary"].get("not_measured"),
                          "intervals": [p.get("calls_hz") for iv in rep["intervals"] for p in iv["processes"]]}
        else:
            short[how] = {"error": r.stderr[-600:]}
        print("short", how, short[how], flush=True)
    doc["short"] = short
    (out / "frameworks.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    shutil.rmtree(work / "__pycache__", ignore_errors=True)
    print(f"wrote {out / 'frameworks.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
