#!/usr/bin/env python3
"""The audit checked with resolution (issue 40, part 3): for each workload, the shim's emulated layer
switched on and off quickly over the control socket within one warm process, against the audit's
bounds from a 5-s `gputrace attach -p PID` of that same process.

Per workload (bench/gpu_jobs.py: jax, kvcache, graph, conv, gpt2, matmul), started under the shim
(`gputrace run --checkpointable`), all started at once and each idle while another is measured:

  1. rapid alternation: the job runs one long phase (`run T stamps`, the end of every step) while this
     script switches the emulated layer (`emulate cost=C layer=shim`: the functions the audit's shim
     preset counts) on and off every `phase_s` (sub-second: about 10 of the job's steps, 0.1-0.5 s),
     the costs (0.5, 2 and 10 us a call) interleaved in a seeded random order:
     off C1 off C2 off C3 off C2 ... Each phase's rate is from the step ends inside it (first to last:
     no step cut by a switch is counted, no quantisation to whole steps), and each phase with the
     layer on is held against the mean rate of its two neighbours without it (drift cancels to
     first order); its slowdown is time-based, (neighbours' rate / its rate) - 1, as the audit's
     "added seconds per second". Chunks of pairs are added until every cost has at least --pairs
     (60) and its median's 95% interval (seeded bootstrap) is within +-1 point (--target), or the
     workload's time is up. The shim's own counts give the calls it slowed and what its spins took;
  2. the audit: a 5-s `gputrace attach -p PID --preset shim` in the same process (the layer off), its
     report's audit worked out again at each cost (the same snapshot and threads through
     tracer/audit.py's `audit`: `audit_at`), with its ranged bounds (the rates' 95% intervals);
  3. the verdict: the measured median inside the bounds within 1 point.

Writes DIR/WORKLOAD.json as each workload finishes (the attach report beside it, xz-compressed), and
DIR/summary.json and DIR/summary.md after each; a workload whose file is there is skipped, so running
the same command again resumes. Before each workload it checks that the least it needs fits in what
is left of --budget-s; if not, it stops with exit status 3 ("run it again").

On the GPU machine, one device call (at most 9 minutes with the ~40 s of set-up; repeat it until it
exits 0, the results carried back and forth as in bench/overhead_suite.py):
    source bench/gpu-env.sh && python3 bench/audit_validate.py --out bench/results/audit-validate-h100 \\
        --budget-s 460 --pack $OUT/audit-validate.tar.xz
and here, after each call: tar -C bench/results -xJf <files_at>/audit-validate.tar.xz
Here, without a GPU (simcuda's launch_bound_py speaks the jobs' protocol; root for the tracer):
    .venv/bin/python bench/audit_validate.py --sim --out /tmp/audit-validate-sim
"""

from __future__ import annotations

import argparse
import bisect
import lzma
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import audit_gpu  # noqa: E402  (bench/, beside this file)
from provenance import commit, device_name  # noqa: E402

SCHEMA = "gputrace.bench.audit_validate/1"
WORKLOADS = ("jax", "kvcache", "graph", "conv", "gpt2", "matmul")
COSTS_NS = (500.0, 2000.0, 10000.0)
EXIT_MORE = 3
STEPS_PER_PHASE = 10     # a phase's length, in the job's steps (within MIN_PHASE_S..MAX_PHASE_S)
MIN_PHASE_S, MAX_PHASE_S = 0.1, 0.5
MIN_STEPS = 3            # step ends a phase needs for a rate
LEAD_S = 0.3             # between asking the job for a phase and the first switch (it starts stepping)
ATTACH_S = 5.0
ATTACH_RESERVE_S = 15.0  # the attach: its compile and calibration, 5 s, and the phase around it
SETTLE_S = 0.02          # after a switch is acknowledged, before its phase counts (a step in flight)


# --- the arithmetic (tests/test_audit_validate.py) --------------------------------------------------------


def phase_rate(stamps: list[float], a: float, b: float) -> float | None:
    """Steps a second within [a, b]: from the first step end inside to the last, so only whole steps
    that began and ended inside count; None with fewer than MIN_STEPS ends inside."""
    i, j = bisect.bisect_left(stamps, a), bisect.bisect_right(stamps, b)
    if j - i < MIN_STEPS or stamps[j - 1] <= stamps[i]:
        return None
    return (j - i - 1) / (stamps[j - 1] - stamps[i])


def schedule(costs: list[float], pairs: int, rng: random.Random) -> list[float | None]:
    """off C off C ... off: `pairs` phases of each cost, each between two without the layer (None),
    the costs in a random order within each round of them."""
    on: list[float] = []
    for _ in range(pairs):
        rnd = list(costs)
        rng.shuffle(rnd)
        on += rnd
    out: list[float | None] = [None]
    for c in on:
        out += [c, None]
    return out


def slowdowns(phases: list[dict]) -> dict[float, list[float]]:
    """Each phase with the layer on against the mean rate of its two neighbours without it (both
    measured), by cost: (neighbours' rate / its rate) - 1."""
    out: dict[float, list[float]] = {}
    for k in range(1, len(phases) - 1):
        p, before, after = phases[k], phases[k - 1], phases[k + 1]
        if p["cost_ns"] is None or before["cost_ns"] is not None or after["cost_ns"] is not None:
            continue
        if not p["rate"] or not before["rate"] or not after["rate"]:
            continue
        out.setdefault(p["cost_ns"], []).append((before["rate"] + after["rate"]) / 2 / p["rate"] - 1)
    return out


def half_width(ci: dict) -> float | None:
    if ci["lo"] is None or ci["hi"] is None:
        return None
    return max(ci["median"] - ci["lo"], ci["hi"] - ci["median"])


def audit_at(report: dict, cost_ns: float, scale: float = 1.0, exact: bool = False) -> dict:
    """The shim preset's audit of an attach report, worked out again at `cost_ns` a call: the report's
    snapshot, and its calling threads as the report gives them (each one's share of the intercepted
    calls, its times on and off a CPU, its wait), through tracer/audit.py's own `audit`. `scale`
    multiplies every function's rate (and its interval): the job's calls at another speed of it;
    `exact`: the rates taken as exact (no interval), for the model's bounds at a rate known otherwise."""
    import dataclasses

    from gputrace.tracer.audit import audit, make_preset
    from gputrace.tracer.model import ProcessSnapshot
    from gputrace.tracer.threads import ThreadSlack

    (a0,) = [a for a in report["audits"] if a["preset"] == "shim"]
    snap = ProcessSnapshot.from_dict(report["summary"])
    if scale != 1.0 or exact:
        snap = dataclasses.replace(snap, functions=tuple(
            dataclasses.replace(f, rate_hz=f.rate_hz * scale, calls_estimated=f.calls_estimated * scale,
                                rate_err_hz=0.0 if exact else None if f.rate_err_hz is None else f.rate_err_hz * scale,
                                not_known=None if exact else f.not_known)
            for f in snap.functions))
    threads = None
    if a0.get("lower_basis") == "threads" and a0.get("threads") is not None:
        wait = snap.wait_s_per_s
        threads = tuple(
            ThreadSlack(t["tid"], t["comm"], {f: t["intercepted_share"] for f in a0["functions"]}, t["run_s_per_s"],
                        t["runq_s_per_s"], t["off_s_per_s"],
                        None if t["wait_s_per_s"] is None else (t["wait_s_per_s"] / wait if wait else 0.0))
            for t in a0["threads"])
    return audit(snap, make_preset("shim", cost_ns), threads, a0.get("pacer")).to_dict()


def verdict(measured: float | None, bounds: dict, slack: float = 0.01) -> dict:
    """The measured median against the audit's bounds, within `slack`: at the rates as read (`point`)
    and with their 95% intervals (`ranged`, where known). None where a bound is not known."""
    def inside(lo, hi):
        if measured is None or hi is None:
            return None
        return (lo is None or lo - slack <= measured) and measured <= hi + slack

    lo_r = bounds["slowdown_lower_min"] if bounds["slowdown_lower_min"] is not None else bounds["slowdown_lower"]
    hi_r = bounds["slowdown_upper_max"] if bounds["slowdown_upper_max"] is not None else bounds["slowdown_upper"]
    return {"point": inside(bounds["slowdown_lower"], bounds["slowdown_upper"]), "ranged": inside(lo_r, hi_r),
            "lower_known": bounds["slowdown_lower"] is not None}


# --- on a job ---------------------------------------------------------------------------------------------


def alternate(job: audit_gpu.Job, conn, sched: list[float | None], phase_s: float) -> tuple[list[dict], dict]:
    """One `run ... stamps` of the job, the layer switched on the schedule within it. Returns the
    phases ({cost_ns, a, b, rate}) and, by cost, the shim's counts over its phases on (calls slowed,
    ns its spins took)."""
    total = LEAD_S + len(sched) * phase_s + 0.1
    job.proc.stdin.write(f"run {total:.3f} stamps\n")
    job.proc.stdin.flush()
    t_start = time.monotonic() + LEAD_S
    marks: list[tuple[float | None, float, float]] = []  # (cost, acknowledged, next switch sent)
    counts: dict[float, dict] = {}
    prev_on: float | None = None
    for k, cost in enumerate(sched + [None]):
        due = t_start + k * phase_s
        while (left := due - time.monotonic()) > 0:
            time.sleep(left)  # the phases are spans of the job's own time: waited out, as a schedule
        sent = time.monotonic()
        if marks:
            marks[-1] = (marks[-1][0], marks[-1][1], sent)
        r = conn.request("emulate off" if cost is None else f"emulate cost={int(cost)} layer=shim")
        if not r.get("ok"):
            raise SystemExit(f"the shim refused to switch the emulated layer: {r}")
        if prev_on is not None:  # this reply ends a phase on: its counts are that phase's
            e = r.get("emulate", {})
            c = counts.setdefault(prev_on, {"calls_slowed": 0, "spent_ns": 0, "on_s": 0.0})
            c["calls_slowed"] += e.get("calls_slowed") or 0
            c["spent_ns"] += e.get("spent_ns") or 0
            c["on_s"] += sent - marks[-1][1]
        if cost is not None and prev_on is None:
            c = counts.setdefault(cost, {"calls_slowed": 0, "spent_ns": 0, "on_s": 0.0})
            c.setdefault("functions", r.get("emulate", {}).get("functions"))
        prev_on = cost
        if k < len(sched):
            marks.append((cost, time.monotonic(), float("inf")))
    ans = orjson.loads(job.proc.stdout.readline())
    stamps = ans["stamps"]
    phases = [{"cost_ns": c, "a": a, "b": b, "rate": phase_rate(stamps, a + SETTLE_S, b)} for c, a, b in marks]
    return phases, counts


def measure(job: audit_gpu.Job, costs: list[float], *, phase_s: float, min_pairs: int, max_pairs: int,
            chunk_pairs: int, target: float, until: float, seed: int) -> dict:
    """Chunks of rapid alternation until every cost has `min_pairs` and a 95% interval within
    +-`target`, `max_pairs` are reached, or the next chunk would end past `until` (monotonic)."""
    from gputrace.shim.client import Connection

    rng = random.Random(seed)
    phases: list[dict] = []
    counts: dict[float, dict] = {}
    slows: dict[float, list[float]] = {c: [] for c in costs}
    chunks = 0
    with Connection(job.pid) as conn:
        while True:
            have = {c: len(slows[c]) for c in costs}
            cis = {c: audit_gpu.median_ci(slows[c]) for c in costs}
            resolved = all(have[c] >= min_pairs and (half_width(cis[c]) or 1.0) <= target for c in costs)
            if resolved or min(have.values()) >= max_pairs:
                break
            # As many pairs as the time left holds, up to a chunk (a run of the job, answered at its end).
            fit = int((until - time.monotonic() - LEAD_S - 1.0 - phase_s) / (2 * len(costs) * phase_s))
            n = min(chunk_pairs, fit, max_pairs - min(have.values()))
            if n < 2:
                break
            ph, cn = alternate(job, conn, schedule(costs, n, rng), phase_s)
            chunks += 1
            phases += ph
            for c, v in cn.items():
                d = counts.setdefault(c, {"calls_slowed": 0, "spent_ns": 0, "on_s": 0.0})
                for k in ("calls_slowed", "spent_ns", "on_s"):
                    d[k] += v[k]
                d.setdefault("functions", v.get("functions"))
            for c, xs in slowdowns(ph).items():
                slows[c] += xs
        conn.request("emulate off")
    off_rates = [p["rate"] for p in phases if p["cost_ns"] is None and p["rate"]]
    out = {}
    for c in costs:
        ci = audit_gpu.median_ci(slows[c])
        on_rates = [p["rate"] for p in phases if p["cost_ns"] == c and p["rate"]]
        cn = counts.get(c, {"calls_slowed": 0, "spent_ns": 0, "on_s": 0.0})
        out[str(int(c))] = {
            "cost_ns": c, "pairs": len(slows[c]), "slowdowns": slows[c], "median": ci["median"], "lo": ci["lo"],
            "hi": ci["hi"], "half_width": half_width(ci), "resolved": len(slows[c]) >= min_pairs and
            (half_width(ci) or 1.0) <= target,
            "mean": statistics.mean(slows[c]) if slows[c] else None,
            "off_steps_per_s": statistics.median(off_rates) if off_rates else None,
            "on_steps_per_s": statistics.median(on_rates) if on_rates else None,
            "calls_slowed": cn["calls_slowed"], "spent_ns": cn["spent_ns"], "on_s": cn["on_s"],
            "spent_per_call_ns": cn["spent_ns"] / cn["calls_slowed"] if cn["calls_slowed"] else None,
            "slowed_per_s": cn["calls_slowed"] / cn["on_s"] if cn["on_s"] else None,
            "functions": cn.get("functions"),
        }
    return {"phase_s": phase_s, "chunks": chunks, "phases": len(phases),
            "phases_without_rate": sum(p["rate"] is None for p in phases), "costs": out}


def run_workload(name: str, job: audit_gpu.Job, d: Path, a: argparse.Namespace, until: float, sim: bool) -> dict:
    t0 = time.monotonic()
    doc: dict = {"schema": SCHEMA, "workload": name, "device": device_name(sim), "commit": commit(), "pid": job.pid,
                 "config": {"costs_ns": a.costs, "min_pairs": a.pairs, "max_pairs": a.max_pairs, "target": a.target,
                            "attach_s": ATTACH_S, "sim": sim}}
    probe = job.run(0.5)
    step_s = 1.0 / probe["steps_per_s"] if probe["steps_per_s"] else MAX_PHASE_S
    phase_s = min(MAX_PHASE_S, max(MIN_PHASE_S, STEPS_PER_PHASE * step_s))
    doc["steps_per_s_probe"] = probe["steps_per_s"]
    doc["alternation"] = measure(job, a.costs, phase_s=phase_s, min_pairs=a.pairs, max_pairs=a.max_pairs,
                                 chunk_pairs=a.chunk_pairs, target=a.target, until=until - ATTACH_RESERVE_S,
                                 seed=a.seed)
    alt = doc["alternation"]["costs"]
    for c, m in alt.items():
        print(f"  {name} {float(c) / 1000:g} us: {audit_gpu.fmt_pct(m['median'])} (95% CI {audit_gpu.fmt_pct(m['lo'])}"
              f"..{audit_gpu.fmt_pct(m['hi'])}, {m['pairs']} pairs of {1000 * phase_s:.0f} ms"
              f"{'' if m['resolved'] else ', NOT resolved to the target'})", flush=True)
    # The audit, last: a uprobe leaves its page of libcuda copied in the process after it is gone.
    out = d / f"{name}-attach.json"
    # (Its audits are at the presets' costs; the shim preset's, worked out again at each cost below,
    # has the same functions and threads at any cost.)
    ph, rep = audit_gpu.attach_phase(job, ATTACH_S, out)
    s = rep["summary"]
    a0, b0 = rep["attach"]["started_monotonic_s"], rep["attach"]["started_monotonic_s"] + s["interval_s"]
    st = ph.get("stamps") or []
    n = bisect.bisect_left(st, b0) - bisect.bisect_left(st, a0)
    doc["attach"] = {"file": out.name + ".xz", "session_s": s["interval_s"],
                     "session_steps_per_s": n / s["interval_s"] if s["interval_s"] else None,
                     "tracer_overhead": s.get("tracer_overhead"), "calls_hz": s.get("calls_hz")}
    doc["bounds"] = {}
    for c, m in alt.items():
        b = audit_at(rep, float(c))
        keep = ("intercepted_hz", "intercepted_err_hz", "added_cpu_s_per_s", "slowdown_lower", "slowdown_upper",
                "slowdown_lower_min", "slowdown_upper_max", "not_known", "lower_basis", "wait_s_per_s", "functions")
        row = {k: b[k] for k in keep}
        row["threads"] = [{k: t[k] for k in ("tid", "comm", "intercepted_share", "added_s_per_s", "headroom_s_per_s",
                                              "exposed", "cpu_share")} for t in b["threads"] or ()]
        row["pacer"] = b["pacer"]
        # The layer's true added time: the calls it slowed a second while on, put at the untraced
        # speed (calls a step x steps/s without it), x its cost.
        if m["slowed_per_s"] and m["on_steps_per_s"] and m["off_steps_per_s"]:
            row["added_from_slowed_calls"] = m["slowed_per_s"] / m["on_steps_per_s"] * m["off_steps_per_s"] * float(c) * 1e-9
        row["verdict"] = verdict(m["median"], b)
        # Two checks that tell a rate misread from a model that does not hold: the rates put at the
        # alternation's speed (the job's speed drifts between the attach and the phases), and the
        # intercepted rate replaced by the truth (the calls the layer slowed, at that speed).
        k = (m["off_steps_per_s"] / doc["attach"]["session_steps_per_s"]
             if m["off_steps_per_s"] and doc["attach"]["session_steps_per_s"] else None)
        row["speed_scale"] = k
        if k is not None:
            bm = audit_at(rep, float(c), k)
            row["at_alternation_speed"] = {x: bm[x] for x in keep[:7]} | {"verdict": verdict(m["median"], bm)}
        a_read = audit_at(rep, float(c), exact=True)["added_cpu_s_per_s"]  # at the rates as read (a range's middle)
        if row.get("added_from_slowed_calls") and a_read:
            bt = audit_at(rep, float(c), row["added_from_slowed_calls"] / a_read, exact=True)
            row["at_true_rate"] = {x: bt[x] for x in ("added_cpu_s_per_s", "slowdown_lower", "slowdown_upper")} | {
                "verdict": verdict(m["median"], bt)}
        doc["bounds"][c] = row
        v = row["verdict"]
        print(f"  {name} {float(c) / 1000:g} us: audit {audit_gpu.fmt_pct(b['slowdown_lower'])}..."
              f"{audit_gpu.fmt_pct(b['slowdown_upper'])} (with the rates' intervals {audit_gpu.fmt_pct(row['slowdown_lower_min'])}"
              f"..{audit_gpu.fmt_pct(row['slowdown_upper_max'])}; {b['lower_basis']}): measured "
              f"{'inside' if v['ranged'] else 'OUTSIDE' if v['ranged'] is False else 'not comparable'}", flush=True)
    for raw in (out, out.with_suffix(".obs.json")):  # committed compressed (audit_gpu.read_json reads them)
        if raw.exists():
            raw.with_name(raw.name + ".xz").write_bytes(lzma.compress(raw.read_bytes()))
            raw.unlink()
    doc["wall_s"] = time.monotonic() - t0
    return doc


# --- the summary -------------------------------------------------------------------------------------------


def summarize(d: Path) -> dict:
    rows = []
    docs = []
    for path in d.glob("*.json"):
        try:
            doc = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            docs.append(doc)
    order = {w: i for i, w in enumerate(WORKLOADS)}
    for doc in sorted(docs, key=lambda x: (order.get(x["workload"], len(order)), x["workload"])):
        w = doc["workload"]
        if doc.get("failed"):
            rows.append({"workload": w, "failed": doc["failed"]})
            continue
        for c, m in doc["alternation"]["costs"].items():
            b = doc.get("bounds", {}).get(c, {})
            rows.append({"workload": w, "cost_ns": float(c), "measured": m["median"], "ci": [m["lo"], m["hi"]],
                         "pairs": m["pairs"], "phase_s": doc["alternation"]["phase_s"], "resolved": m["resolved"],
                         "lower": b.get("slowdown_lower"), "upper": b.get("slowdown_upper"),
                         "lower_min": b.get("slowdown_lower_min"), "upper_max": b.get("slowdown_upper_max"),
                         "lower_basis": b.get("lower_basis"), "not_known": b.get("not_known"),
                         "inside_point": b.get("verdict", {}).get("point"),
                         "inside_ranged": b.get("verdict", {}).get("ranged"),
                         "inside_at_alternation_speed": (b.get("at_alternation_speed") or {}).get("verdict", {}).get("ranged"),
                         "true_added": b.get("added_from_slowed_calls"),
                         "true_rate_lower": (b.get("at_true_rate") or {}).get("slowdown_lower"),
                         "true_rate_upper": (b.get("at_true_rate") or {}).get("slowdown_upper"),
                         "inside_at_true_rate": (b.get("at_true_rate") or {}).get("verdict", {}).get("point"),
                         "device": doc.get("device"), "commit": doc.get("commit")})
    return {"schema": SCHEMA + "/summary", "rows": rows}


def summary_md(s: dict) -> str:
    def pct(x):
        return "not known" if x is None else f"{100 * x:+.1f}%"

    yes = {True: "yes", False: "NO", None: "not known"}
    out = ["| workload | cost | measured (95% CI) | pairs x phase | audit (rates as read) | with the rates' 95% intervals "
           "| basis | inside (1 pt) | inside, rates at the phases' speed | the layer's true added time: bounds, inside |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        if "failed" in r:
            out.append(f"| {r['workload']} | | failed: {r['failed'][:120]} | | | | | | | |")
            continue
        ci = "" if r["ci"][0] is None else f" ({pct(r['ci'][0])}..{pct(r['ci'][1])})"
        true = "not known" if r.get("true_added") is None else (
            f"{pct(r['true_added'])}: {pct(r.get('true_rate_lower'))}..{pct(r.get('true_rate_upper'))}, "
            f"{yes[r.get('inside_at_true_rate')]}")
        out.append(f"| {r['workload']} | {r['cost_ns'] / 1000:g} us | {pct(r['measured'])}{ci}"
                   f"{'' if r['resolved'] else ' (interval wider than +-1 pt)'} | {r['pairs']} x {1000 * r['phase_s']:.0f} ms "
                   f"| {pct(r['lower'])}..{pct(r['upper'])} | {pct(r['lower_min'])}..{pct(r['upper_max'])} "
                   f"| {r['lower_basis']} | {yes[r['inside_ranged']]} | {yes[r.get('inside_at_alternation_speed')]} | {true} |")
    return "\n".join(out) + "\n"


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def write_summary(d: Path) -> dict:
    s = summarize(d)
    write_atomic(d / "summary.json", orjson.dumps(s, option=orjson.OPT_INDENT_2))
    write_atomic(d / "summary.md", summary_md(s).encode())
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory of the results (a workload done there is skipped)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated (default {','.join(WORKLOADS)})")
    ap.add_argument("--costs", default=",".join(str(int(c)) for c in COSTS_NS), help="the emulated layer's ns a call")
    ap.add_argument("--pairs", type=int, default=60, help="the least pairs a cost gets (each on phase between two off)")
    ap.add_argument("--max-pairs", type=int, default=240, help="the most pairs a cost gets")
    ap.add_argument("--chunk-pairs", type=int, default=20, help="pairs of each cost in one run of the job")
    ap.add_argument("--target", type=float, default=0.01, help="the 95%% interval's half-width to reach (default 0.01: 1 point)")
    ap.add_argument("--budget-s", type=float, default=460.0,
                    help="the whole call's seconds from this script's start (default 460: a 9-minute device call less set-up)")
    ap.add_argument("--workload-s", type=float, default=85.0, help="the most one workload takes, its attach included")
    ap.add_argument("--min-workload-s", type=float, default=40.0,
                    help="below this much time for a workload, stop (exit 3) rather than start it")
    ap.add_argument("--seed", type=int, default=40)
    ap.add_argument("--sim", "--simcuda", action="store_true", help="simcuda instead of a GPU: a run of the harness here")
    ap.add_argument("--pack", metavar="FILE.tar.xz", help="after every workload, the results directory packed there")
    ap.add_argument("--retry-failed", action="store_true", help="run again the workloads recorded as failed")
    ap.add_argument("--summary-only", action="store_true", help="only write summary.json and summary.md from --out")
    a = ap.parse_args(argv)
    start = time.monotonic()
    d = Path(a.out)
    d.mkdir(parents=True, exist_ok=True)
    a.costs = [float(c) for c in a.costs.split(",")]
    if a.summary_only:
        sys.stdout.write(summary_md(write_summary(d)))
        return 0
    if a.sim:
        import overhead_suite

        overhead_suite.setup_sim()
    elif shutil.which("gputrace") is None:
        raise SystemExit("audit_validate: gputrace is not on PATH: source bench/gpu-env.sh first")

    def pending() -> list[str]:
        out = []
        for w in a.workloads.split(","):
            p = d / f"{w}.json"
            if not p.exists() or (a.retry_failed and orjson.loads(p.read_bytes()).get("failed")):
                out.append(w)
        return out

    todo = pending()
    if not todo:
        print(f"every workload is done in {d}", flush=True)
        sys.stdout.write(summary_md(write_summary(d)))
        return 0
    # Every pending workload's process started at once: their set-up (PyTorch, transformers, JAX's
    # compile) overlaps; each is idle (blocked on its stdin) while another is measured.
    jobs: dict[str, audit_gpu.Job] = {}
    failed: dict[str, str] = {}
    for w in todo:
        try:
            jobs[w] = audit_gpu.Job(w, shim=True, wait=False)
        except OSError as exc:
            failed[w] = f"did not start: {exc}"
    status = 0
    try:
        for w in todo:
            path = d / f"{w}.json"
            t0 = time.monotonic()
            try:
                if w in failed:
                    raise SystemExit(failed[w])
                jobs[w].ready()
                left = a.budget_s - (time.monotonic() - start)
                # An equal share of what is left, at least --min-workload-s (the rest then resume in
                # the next call) and at most --workload-s.
                share = min(a.workload_s, max(a.min_workload_s, left / (len(todo) - todo.index(w))))
                if share > left:
                    rest = len(pending())
                    print(f"stopping before {w}: {max(left, 0):.0f} s of the budget left, and a workload takes at least "
                          f"{a.min_workload_s:.0f} s; {rest} workload(s) to go: run the same command again", flush=True)
                    status = EXIT_MORE
                    break
                print(f"{w}: starting ({left:.0f} s of the budget left, {share:.0f} s for it)", flush=True)
                doc = run_workload(w, jobs[w], d, a, time.monotonic() + share, a.sim)
            except (SystemExit, OSError, ValueError, KeyError, orjson.JSONDecodeError) as exc:
                why = f"{type(exc).__name__}: {exc}"[:2000]
                doc = {"schema": SCHEMA, "workload": w, "failed": why, "device": device_name(a.sim), "commit": commit(),
                       "wall_s": time.monotonic() - t0}
                print(f"{w}: FAILED after {time.monotonic() - t0:.0f} s ({why}); recorded, going on", flush=True)
            else:
                print(f"{w}: done in {doc['wall_s']:.0f} s", flush=True)
            write_atomic(path, orjson.dumps(doc, option=orjson.OPT_INDENT_2))
            try:
                jobs[w].close()
            except (OSError, ValueError, KeyError):
                jobs[w].proc.kill()
            write_summary(d)
            if a.pack:
                import overhead_suite

                overhead_suite.pack(d, Path(a.pack))
    finally:
        for j in jobs.values():
            if j.proc.poll() is None:
                j.proc.kill()
                j.proc.wait()
    s = write_summary(d)
    sys.stdout.write(summary_md(s))
    if status == 0:
        bad = [r["workload"] for r in s["rows"] if "failed" in r]
        print(f"all workloads run in {d}" + (f"; failed: {', '.join(bad)} (--retry-failed runs them again)" if bad else ""),
              flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
