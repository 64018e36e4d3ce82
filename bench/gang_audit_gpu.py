#!/usr/bin/env python3
"""The audit of a job of several processes, per rank and per job, checked on one real GPU.

    python3 bench/gang_audit_gpu.py --out OUT.json [--ranks 2] [--attach-s 5] [--cost-ns 2000]

The job (bench/gang_job.py): a torch.distributed launcher and --ranks ranks training one model with
DistributedDataParallel over gloo (gradients all-reduced every step), all on the one GPU, started
under `gputrace run --checkpointable` so that every rank runs the shim. It trains without pause
while, from another process, as a user runs them:

  1. `gputrace attach --tree LAUNCHER --exact -d S`: every call of every rank counted, over the
     steps the job made meanwhile: each rank's calls per step (the truth);
  2. `gputrace attach --tree LAUNCHER -d S --preset shim --cost-ns C` twice (the default 1% budget):
     each rank's rates against calls per step x the steps/s the job made in that attach, and the
     job's audit: the slowdown a layer adding C ns to every submission and state call would cause;
  3. that layer, emulated on every rank at once (`gputrace shim emulate --tree LAUNCHER --cost-ns C
     --classes submission,state`), in phases alternating with phases without it: the job's measured
     slowdown (median of the paired phases, with its interval) beside the audit's bounds.

Writes OUT.json and OUT.md.  Run after `source bench/gpu-env.sh`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoint_gpu import cli, gputrace, log, results_main  # noqa: E402
from gang_gpu import Gang  # noqa: E402

BATCH = 10  # steps a train command; the steps' times are the batches' ends


class Trainer:
    """Trains the job in batches on a thread until stopped; the time each batch ended."""

    def __init__(self, job: Gang) -> None:
        self.job, self.ends, self.stop = job, [], threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.job.cmd(f"train {BATCH}")
                self.ends.append(time.monotonic())
        except BaseException as e:  # noqa: BLE001: reported by join
            self.error = e

    def join(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.error:
            raise RuntimeError(f"training stopped: {self.error}")

    def steps_between(self, a: float, b: float) -> float:
        return BATCH * sum(a < t <= b for t in self.ends)


SAVED: list[Path] = []


def attach(trainer: Trainer, target: list[str], seconds: float, *extra: str, save: Path | None = None) -> dict:
    """One attach while the job trains; its report (kept at `save`) and the job's steps/s over the
    span traced."""
    p = subprocess.run([gputrace(), "attach", *target, "-d", str(seconds), "-q", "--json", *extra],
                       capture_output=True, text=True)
    end = time.monotonic()
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-800:], "rc": p.returncode}
    rep = json.loads(p.stdout)
    if save is not None:
        save.write_text(p.stdout)
        SAVED.append(save)
    span = rep.get("traced_s") or rep.get("summary", {}).get("interval_s")
    rep["steps_per_s"] = trainer.steps_between(end - span, end) / span if span else None
    return rep


def rank_rates(rep: dict) -> dict:
    """{pid: {function: [rate, err]}} of a job report (or of one process's)."""
    out = {}
    if "ranks" not in rep:
        s = rep["summary"]
        return {str(s["pid"]): {f["name"]: [f["rate_hz"], f["rate_err_hz"]] for f in s.get("functions", [])}}
    for r in rep["ranks"]:
        s = r.get("summary") or {}
        out[str(r["pid"])] = {f["name"]: [f["rate_hz"], f["rate_err_hz"]] for f in s.get("functions", [])}
    return out


def phase(job: Gang, seconds: float) -> float:
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        job.cmd(f"train {BATCH}")
        n += BATCH
    return n / (time.monotonic() - t0)


def median_ci(xs: list[float]) -> list[float]:
    """The median and a distribution-free 95% interval of it (order statistics; the whole range for
    fewer than six)."""
    s = sorted(xs)
    n = len(s)
    if n < 6:
        return [statistics.median(s), s[0], s[-1]]
    k = max(0, int(n / 2 - 0.98 * n ** 0.5))
    return [statistics.median(s), s[k], s[n - 1 - k]]


def run(a) -> dict:
    res: dict = {"ranks": a.ranks, "attach_s": a.attach_s, "cost_ns": a.cost_ns}
    job = Gang(True, a.ranks, 29519)
    tree = str(job.launcher)
    res["pids"] = {"launcher": job.launcher, "ranks": job.ranks}
    try:
        phase(job, 2.0)  # warm
        trainer = Trainer(job)
        try:
            log("exact attach (truth)")
            here = a.out.parent
            ex = attach(trainer, ["--tree", tree], a.attach_s, "--exact", save=here / "gang-exact.json")
            res["exact"] = {k: ex.get(k) for k in ("traced_s", "steps_per_s", "error")}
            per_step = {}
            if "error" not in ex:
                for pid, fs in rank_rates(ex).items():
                    per_step[pid] = {n: v[0] / ex["steps_per_s"] for n, v in fs.items() if v[0]}
            res["calls_per_step"] = per_step
            res["default"] = []
            # The job's ranks through --tree (the host-wide tracer, every rank), then one rank alone
            # through -p (the single-process tracer), each --reps times.
            plans = [(["--tree", tree], f"tree-{i}") for i in range(a.reps)]
            plans += [(["-p", str(job.ranks[0])], f"rank0-{i}") for i in range(a.reps)]
            for i, (target, tag) in enumerate(plans):
                log(f"default-budget attach {' '.join(target)} ({i + 1}/{len(plans)})")
                rep = attach(trainer, target, a.attach_s, "--preset", "shim", "--cost-ns", str(a.cost_ns),
                             save=here / f"gang-{tag}.json")
                if "error" in rep:
                    res["default"].append(rep)
                    continue
                rows = []
                for pid, fs in rank_rates(rep).items():
                    for name, ps in per_step.get(pid, {}).items():
                        true = ps * rep["steps_per_s"]
                        if true < 1000:
                            continue
                        est, err = fs.get(name, [None, None])
                        rows.append({"pid": pid, "function": name, "truth_hz": true, "estimate_hz": est,
                                     "err_hz": err, "rel_error": None if est is None else est / true - 1,
                                     "covered": est is not None and err is not None and abs(est - true) <= err})
                job_audit = next((j for j in rep.get("job", []) if j.get("preset") == "shim"), None)
                accounted = [(r.get("summary") or {}).get("tracer_overhead") for r in rep.get("ranks", [rep])]
                res["default"].append({"target": " ".join(target), "traced_s": rep.get("traced_s"),
                                       "steps_per_s": rep["steps_per_s"], "rates": rows,
                                       "job": job_audit, "tracer_overhead": accounted, "notes": rep.get("notes")})
        finally:
            trainer.join()
        log("emulated layer on every rank, alternating phases")
        on = ["--cost-ns", str(a.cost_ns), "--classes", "submission,state"]
        cycles = []
        base = phase(job, a.phase_s)
        for c in range(a.cycles):
            r1 = cli("shim", "emulate", "--tree", tree, *on)
            emu = phase(job, a.phase_s)
            r2 = cli("shim", "emulate", "--tree", tree)  # what it did: calls slowed, spins' time
            cli("shim", "emulate", "--tree", tree, "--off")
            after = phase(job, a.phase_s)
            cycles.append({"untraced_before": base, "emulated": emu, "untraced_after": after,
                           "slowdown": 1 - emu / ((base + after) / 2),
                           "switch_error": r1.get("error"), "ranks": r2.get("ranks"), "calls_slowed": r2.get("calls_slowed")})
            base = after
        res["emulation"] = cycles
        sl = [c["slowdown"] for c in cycles]
        res["emulated_slowdown"] = median_ci(sl)
        bounds = [d["job"] for d in res["default"] if isinstance(d.get("job"), dict)]
        res["audit_bounds"] = [[b.get("slowdown_lower"), b.get("slowdown_upper")] for b in bounds]
        m = res["emulated_slowdown"][0]
        res["inside_within_1pt"] = [lo is not None and hi is not None and lo - 0.01 <= m <= hi + 0.01
                                    for lo, hi in res["audit_bounds"]]
    finally:
        job.close()
    return res


def summary(r: dict) -> str:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = [f"# The audit of a {r['ranks']}-rank job (DDP over gloo, one GPU), per rank and per job", "",
             f"Command: `{r['command']}` on {r.get('device', '?')}.", "",
             f"Exact attach ({r['attach_s']:g} s): {r['exact']}", "",
             "## Default-budget attaches: each rank's rates against calls per step x the job's steps/s", ""]
    for i, d in enumerate(r.get("default", [])):
        if "error" in d:
            lines.append(f"- attach {i + 1}: error {d['error'][:300]}")
            continue
        rows = d["rates"]
        errs = [abs(x["rel_error"]) for x in rows if x["rel_error"] is not None]
        lines.append(f"- attach {i + 1} (`{d.get('target', '--tree')}`): {d['steps_per_s']:.1f} steps/s; {len(rows)} (rank, function) pairs above 1k/s: "
                     f"{sum(e <= 0.1 for e in errs)} within ±10%, {sum(x['covered'] for x in rows)} inside the stated 95% interval, "
                     f"largest error {pct(max(errs) if errs else None)}; tracer's accounted cost by rank "
                     f"{[pct(x) for x in d['tracer_overhead']]}; the job's audit at {r['cost_ns']} ns "
                     f"(submission+state): {pct((d['job'] or {}).get('slowdown_lower'))} .. {pct((d['job'] or {}).get('slowdown_upper'))}")
    m = r.get("emulated_slowdown")
    if m:
        lines += ["", "## The emulated layer on every rank at once", "",
                  f"- {len(r['emulation'])} cycles of {r.get('phase_s', '?')} s: slowdown median {pct(m[0])} "
                  f"(95% interval {pct(m[1])} .. {pct(m[2])}); calls slowed per cycle (all ranks): "
                  f"{[c['calls_slowed'] for c in r['emulation']]}",
                  f"- inside the audit's bounds within a point: {r.get('inside_within_1pt')}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--attach-s", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=2, help="default-budget attaches")
    ap.add_argument("--cost-ns", type=int, default=2000)
    ap.add_argument("--phase-s", type=float, default=3.0)
    ap.add_argument("--cycles", type=int, default=6)

    def go(a):
        r = run(a)
        r["phase_s"] = a.phase_s
        return r

    rc, _ = results_main(ap, go, summary)
    return rc


if __name__ == "__main__":
    sys.exit(main())
