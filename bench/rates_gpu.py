#!/usr/bin/env python3
"""How well `gputrace attach -p PID -d 5` (the default 1% budget) reads each function's call rate, on
real frameworks' jobs that are already running, and on a job traced from its start whose calls change
mid-run: every function above 1k calls/s against the truth.

Truth: the job's exact calls per step (every call counted, in this process's own exact session:
audit_gpu.exact_counts, the same count as `attach --exact`) times the steps the job itself made over
the attach's span (its step-end stamps, interpolated at the span's ends), over the span.

  standing jobs (bench/gpu_jobs.py, warm, set up side by side, each idle while another runs):
    mlp (launch-bound PyTorch), gpt2 (transformers' GPT2 from its config, a training step), kvcache
    (GPT2 decoding with a KV cache), jax (a jitted JAX training step), conv (a small cuDNN conv net):
    one exact count each, then --attaches rounds of one `attach -p PID -d 5 --json` per job;
  switch, traced from its start (`gputrace attach --json -- python bench/gpu_jobs.py --job switch`):
    eager mlp steps for --switch-eager s, then CUDA-graph replays for --switch-graph s; its calls per
    step in each mode from a standing switch job of its own (one exact count eager, one after its
    switch). Rows: the session's summary against the truth over the whole session (set-up calls outside
    the steps are not in the truth: a few thousand, against millions), and the measured intervals that
    lie wholly inside each mode (their rates weighted by length; their half-widths put together in
    quadrature, as if independent).

Per row: truth, estimate, stated 95% half-width, error, covered (|estimate - truth| <= half-width), and
the lockstep ratio's error: a function's estimate over that of the job's busiest function, against
the same ratio of their exact calls per step (the step rate cancels: the estimator's relative error
alone, where both keep a fixed count a step).

On the GPU machine (one device call; bench/rates_gpu.sh installs what it needs and runs this):
    bash bench/rates_gpu.sh
Here, without a GPU (simcuda's launch_bound.py --serve stands in for every job; root for the tracer):
    .venv/bin/python bench/rates_gpu.py --sim --out /tmp/rates-sim --attaches 1
Again from the files (`--reestimate`: the rates worked out again from the observations each attach
saved, by the estimator as it is now; the reports' tar unpacked into DIR/raw first):
    .venv/bin/python bench/rates_gpu.py --reanalyze --out DIR [--reestimate]
Writes OUT/rates.json (rewritten after every step), OUT/raw.tar.xz (the attach reports and their
observations) and prints the table last.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import audit_gpu  # noqa: E402  (bench/, beside this file)
from provenance import commit, device_name  # noqa: E402

SCHEMA = "gputrace.bench.rates/1"
MIN_HZ = 1000.0
STANDING = ("mlp", "gpt2", "kvcache", "jax", "conv")
ATTACH_S = 5.0
ATTACH_COST_S = 12.0   # one attach phase: 5 s + compile and calibration + margin (audit_gpu.attach_phase)
FROM_START_S = 30.0    # the switch job's set-up under the tracer, beside its two modes' seconds
WARMUP = 30            # bench/gpu_jobs.py's --warmup default: steps before `ready`


def log(msg: str) -> None:
    print(msg, flush=True)


# --- truth ------------------------------------------------------------------------------------------------


def steps_done(t0: float, stamps: list[float], t: float) -> float:
    """Steps a phase that began at t0 had made by time t (its step-end stamps, interpolated)."""
    pts = [t0, *stamps]
    i = bisect.bisect_right(pts, t)
    if i <= 0:
        return 0.0
    if i >= len(pts):
        return float(len(stamps))
    a, b = pts[i - 1], pts[i]
    return (i - 1) + ((t - a) / (b - a) if b > a else 0.0)


def span_of(rep: dict) -> tuple[float, float]:
    """The CLOCK_MONOTONIC span the report's intervals cover."""
    t0 = rep["attach"]["started_monotonic_s"]
    ivs = rep["intervals"]
    if not ivs:
        return t0, t0 + rep["summary"]["interval_s"]
    return t0 + ivs[0]["t_start"], t0 + ivs[-1]["t_start"] + ivs[-1]["interval_s"]


def rate_of(f: dict) -> list:
    """A function's [rate, 95% half-width] in a report: where the rate is not known (null, with its
    range beside it: tracer/model.py), the middle of its range and half its width, as estimated."""
    if f["rate_hz"] is None:
        lo, hi = f.get("rate_range_hz") or (None, None)
        return [None, None] if lo is None else [(lo + hi) / 2, (hi - lo) / 2]
    return [f["rate_hz"], f["rate_err_hz"]]


def summary_rates(rep: dict) -> dict[str, list]:
    return {f["name"]: rate_of(f) for f in rep["summary"]["functions"]}


def not_known(rep: dict) -> list[str]:
    """The functions whose rate the report says is not known."""
    return [f["name"] for f in rep["summary"]["functions"] if f.get("not_known")]


def rows_of(truth_hz: dict[str, float], rates: dict[str, list]) -> list[dict]:
    """Every function whose truth is above MIN_HZ against its estimate; the lockstep ratio against
    the busiest function's."""
    hot = sorted(((n, t) for n, t in truth_hz.items() if t >= MIN_HZ), key=lambda kv: -kv[1])
    ref = hot[0][0] if hot else None
    ref_est = (rates.get(ref) or [None])[0] if ref else None
    rows = []
    for name, true in hot:
        est, err = rates.get(name, [None, None])
        ratio = None
        if name != ref and est is not None and ref_est:
            ratio = (est / ref_est) / (true / truth_hz[ref]) - 1
        rows.append({"function": name, "truth_hz": true, "estimate_hz": est, "err_hz": err,
                     "rel_error": None if est is None else est / true - 1,
                     "rel_half_width": None if est is None or err is None else err / true,
                     "covered": est is not None and err is not None and abs(est - true) <= err,
                     "ratio_ref": ref, "ratio_rel_error": ratio})
    return rows


def spurious(truth_hz: dict[str, float], rates: dict[str, list]) -> list[dict]:
    """Functions the attach read above MIN_HZ whose truth is under half that."""
    return [{"function": n, "estimate_hz": r, "err_hz": e, "truth_hz": truth_hz.get(n, 0.0)}
            for n, (r, e) in rates.items() if r is not None and r >= MIN_HZ and truth_hz.get(n, 0.0) < MIN_HZ / 2]


# --- standing jobs ----------------------------------------------------------------------------------------


def start_jobs(names: list[str]) -> dict:
    """The jobs started together and set up side by side; those that fail to start are left out."""
    jobs, failed = {}, {}
    started = {n: audit_gpu.Job(n, shim=False, wait=False) for n in names}
    for n, j in started.items():
        try:
            j.ready()
            jobs[n] = j
            log(f"{n}: ready (pid {j.pid})")
        except (SystemExit, OSError) as exc:
            failed[n] = str(exc)
            log(f"{n}: did not start: {exc}")
            j.proc.kill()
            j.proc.wait()
    return jobs, failed


def one_attach(job, name: str, r: int, raw: Path) -> dict:
    out = raw / f"{name}-attach-{r}.json"
    ph, rep = audit_gpu.attach_phase(job, ATTACH_S, out)
    a, b = span_of(rep)
    steps = steps_done(ph["t0"], ph["stamps"], b) - steps_done(ph["t0"], ph["stamps"], a)
    s = rep["summary"]
    return {"rep": r, "report": out.name, "observations": out.with_suffix(".obs.json").name,
            "span": [a, b], "span_s": b - a, "steps": steps, "steps_per_s": steps / (b - a) if b > a else None,
            "phase": {"t0": ph["t0"], "seconds": ph["seconds"], "steps": ph["steps"]},
            "inside_phase": ph["t0"] <= a and b <= ph["t0"] + ph["seconds"],
            "tracer_overhead": s.get("tracer_overhead"), "calls_hz": s.get("calls_hz"),
            "not_measured": s.get("not_measured"), "windows": rep["attach"].get("windows"),
            "rates": summary_rates(rep), "not_known": not_known(rep)}


# --- the job traced from its start ------------------------------------------------------------------------


class FromStart(audit_gpu.Job):
    """A bench/gpu_jobs.py job under `gputrace attach --json -o REPORT -- JOB`: the job's stdin and
    stdout are attach's (it passes them on), so it answers the same protocol."""

    def __init__(self, name: str, report: Path, obs_dir: Path, warmup: int) -> None:
        self.name = name
        job = os.environ.get("GPUTRACE_BENCH_JOB_CMD")
        argv = job.split() if job else [sys.executable, str(HERE / "gpu_jobs.py"), "--job", name,
                                         "--warmup", str(warmup)]
        obs_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(["gputrace", "attach", "--json", "-q", "-o", str(report), "--", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=os.environ | {"GPUTRACE_OBSERVATIONS": str(obs_dir)})
        self.pid = self.proc.pid


def intervals_within(rep: dict, lo: float, hi: float) -> list[dict]:
    """The measured snapshots of the intervals that lie wholly inside [lo, hi], with their span."""
    t0 = rep["attach"]["started_monotonic_s"]
    out = []
    for iv in rep["intervals"]:
        a = t0 + iv["t_start"]
        b = a + iv["interval_s"]
        if a < lo or b > hi or not iv["processes"]:
            continue
        out.append({"a": a, "b": b, "snap": iv["processes"][0]})
    return out


def pooled_rates(ivs: list[dict]) -> tuple[dict[str, list], float]:
    """Rates over measured intervals weighted by length; half-widths in quadrature (None where one
    interval's is unknown); and the measured seconds."""
    meas = [iv for iv in ivs if not iv["snap"].get("not_measured")]
    total = sum(iv["b"] - iv["a"] for iv in meas)
    if total <= 0:
        return {}, 0.0
    acc: dict[str, list] = {}
    for iv in meas:
        w = iv["b"] - iv["a"]
        for f in iv["snap"]["functions"]:
            a = acc.setdefault(f["name"], [0.0, 0.0, True])
            r, e = rate_of(f)
            a[0] += (r or 0.0) * w
            if e is None:
                a[2] = False
            else:
                a[1] += (e * w) ** 2
    return {n: [s / total, math.sqrt(q) / total if ok else None] for n, (s, q, ok) in acc.items()}, total


def from_start(per_step: dict, raw: Path, eager_s: float, graph_s: float, warmup: int) -> dict:
    report = raw / "switch-from-start.json"
    obs_dir = raw / "switch-from-start.obs"
    job = FromStart("switch", report, obs_dir, warmup)
    t_launch = time.monotonic()
    try:
        job.ready()
        ready_s = time.monotonic() - t_launch
        eager = job.run(eager_s, stamps=True)
        graph = job.run(graph_s, stamps=True)
        job.close()
    except Exception:
        job.proc.kill()
        raise
    if job.proc.returncode:
        raise RuntimeError(f"attach -- switch exited {job.proc.returncode}")
    for f in obs_dir.glob("obs-*.json"):
        f.rename(report.with_suffix(".obs.json"))
    shutil.rmtree(obs_dir, ignore_errors=True)
    return {"report": report.name, "observations": report.with_suffix(".obs.json").name, "ready_s": ready_s,
            "warmup_steps": warmup, "eager": eager, "graph": graph}


def switch_rows(doc: dict, rep: dict, rates: dict[str, list] | None = None) -> dict:
    """The session's rows and each mode's (intervals wholly inside it); `rates`: the session's rates
    worked out again (else the report's)."""
    sw = doc["switch"]
    ps_e, ps_g = doc["exact"]["switch-eager"]["calls_per_step"], doc["exact"]["switch-graph"]["calls_per_step"]
    e, g = sw["eager"], sw["graph"]
    a, b = span_of(rep)

    def steps(ph: dict, lo: float, hi: float) -> float:
        return steps_done(ph["t0"], ph["stamps"], hi) - steps_done(ph["t0"], ph["stamps"], lo)

    n_e = sw["warmup_steps"] + steps(e, a, b)
    n_g = steps(g, a, b)
    names = set(ps_e) | set(ps_g)
    truth = {n: (ps_e.get(n, 0.0) * n_e + ps_g.get(n, 0.0) * n_g) / (b - a) for n in names}
    out = {"span": [a, b], "span_s": b - a, "eager_steps": n_e, "graph_steps": n_g,
           "session": rows_of(truth, rates or summary_rates(rep)),
           "session_spurious": spurious(truth, rates or summary_rates(rep)), "not_known": not_known(rep)}
    for mode, ph, ps in (("eager", e, ps_e), ("graph", g, ps_g)):
        ivs = intervals_within(rep, ph["t0"], ph["t0"] + ph["seconds"])
        pooled, secs = pooled_rates(ivs)
        n = sum(steps(ph, iv["a"], iv["b"]) for iv in ivs if not iv["snap"].get("not_measured"))
        tr = {f: c * n / secs for f, c in ps.items()} if secs else {}
        out[mode] = {"intervals": len(ivs), "measured": sum(not iv["snap"].get("not_measured") for iv in ivs),
                     "measured_s": secs, "steps": n, "rows": rows_of(tr, pooled) if secs else []}
    return out


# --- analysis and the table -------------------------------------------------------------------------------


def reestimated(raw: Path, obs_name: str) -> dict[str, list] | None:
    doc = audit_gpu.read_json(raw / obs_name)
    if doc is None:
        return None
    from gputrace.tracer import estimator as est

    obs, expo = est.load_observations(doc)
    names = doc["functions"]
    return {names[str(f)]: [e.rate_hz, e.err_hz] for f, e in est.estimate(obs, expo).items()}


def analyze(doc: dict, raw: Path, reestimate: bool = False) -> dict:
    """Per workload: its rows (each attach's), from the document and, for the switch job, its report."""
    res: dict = {}
    for name in doc["order"]:
        j = doc["jobs"].get(name)
        if not j or "exact" not in j:
            continue
        ps = j["exact"]["calls_per_step"]
        rows, extra = [], []
        for at in j.get("attaches", []):
            rates = at["rates"]
            if reestimate:
                rates = reestimated(raw, at["observations"]) or rates
            truth = {n: c * at["steps_per_s"] for n, c in ps.items()} if at.get("steps_per_s") else {}
            rows.append(rows_of(truth, rates))
            extra += spurious(truth, rates)
        res[name] = {"attaches": rows, "spurious": extra}
    if doc.get("switch") and "report" in doc["switch"]:
        rep = audit_gpu.read_json(raw / doc["switch"]["report"])
        if rep is not None:
            rates = reestimated(raw, doc["switch"]["observations"]) if reestimate else None
            sw = switch_rows(doc, rep, rates)
            res["switch"] = {"attaches": [sw["session"]], "spurious": sw["session_spurious"], "detail": sw}
            for mode in ("eager", "graph"):
                res[f"switch:{mode}"] = {"attaches": [sw[mode]["rows"]], "spurious": [],
                                         "intervals": [sw[mode]["measured"], sw[mode]["intervals"]]}
    return res


def k(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e3:.1f}k" if abs(x) < 1e6 else f"{x / 1e6:.2f}M"


def pct(x: float | None, signed: bool = True) -> str:
    return "-" if x is None else (f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}")


def short(name: str) -> str:
    return name.replace("MaxActiveBlocksPerMultiprocessor", "MaxActiveBlocksPerMP")[:40]


def totals(res: dict) -> list[str]:
    """One line per workload: its rows covered, within +-10%, missing; the largest error, the
    median stated half-width, the largest lockstep ratio error; functions read hot that were not."""
    out = []
    for w, r in res.items():
        allr = [x for rows in r["attaches"] for x in rows]
        errs = [abs(x["rel_error"]) for x in allr if x["rel_error"] is not None]
        hws = [x["rel_half_width"] for x in allr if x["rel_half_width"] is not None]
        ratios = [abs(x["ratio_rel_error"]) for x in allr if x["ratio_rel_error"] is not None]
        sp = sorted({x["function"] for x in r["spurious"]})
        note = f"; intervals measured {r['intervals'][0]}/{r['intervals'][1]}" if "intervals" in r else ""
        out.append(f"{w}: {len(r['attaches'])} attach, {len(allr)} rows: covered {sum(x['covered'] for x in allr)}, "
                   f"within 10% {sum(e <= 0.10 for e in errs)}, missing {sum(x['estimate_hz'] is None for x in allr)}; "
                   f"max |err| {pct(max(errs) if errs else None, False)}%, median ±{pct(statistics.median(hws) if hws else None, False)}%, "
                   f"max |ratio err| {pct(max(ratios) if ratios else None, False)}%"
                   + (f"; read hot, not so: {', '.join(sp)}" if sp else "") + note)
    return out


def table(res: dict) -> list[str]:
    """One line per workload and function: truth and estimate (means over the attaches), the stated
    half-width (median, % of truth), each attach's error % and covered (y/n), the lockstep ratio's
    error % (mean; 'ref': the function the ratios are taken against)."""
    lines = [f"{'workload':<12} {'function':<40} {'truth/s':>7} {'est/s':>7} {'±95%':>6} {'err % each attach':<18} "
             f"{'cov':<3} {'ratio%':>6}"]
    for w, r in res.items():
        by: dict[str, list[dict]] = {}
        for rows in r["attaches"]:
            for row in rows:
                by.setdefault(row["function"], []).append(row)
        for f, rs in by.items():
            ests = [x["estimate_hz"] for x in rs if x["estimate_hz"] is not None]
            hws = [x["rel_half_width"] for x in rs if x["rel_half_width"] is not None]
            ratios = [x["ratio_rel_error"] for x in rs if x["ratio_rel_error"] is not None]
            errs = " ".join(pct(x["rel_error"]) for x in rs)
            cov = "".join("y" if x["covered"] else "n" for x in rs)
            ratio = "ref" if rs[0]["ratio_ref"] == f else (pct(statistics.mean(ratios)) if ratios else "-")
            hw = ("±" + pct(statistics.median(hws), False)) if hws else "-"
            lines.append(f"{w:<12} {short(f):<40} {k(statistics.mean(x['truth_hz'] for x in rs)):>7} "
                         f"{k(statistics.mean(ests) if ests else None):>7} {hw:>6} {errs:<18} {cov:<3} {ratio:>6}")
    return lines


# --- the run ----------------------------------------------------------------------------------------------


def sources() -> dict[str, str]:
    """The estimator's and the budget's modules as imported here (the tree sent may be uncommitted)."""
    import hashlib

    from gputrace.tracer import budget, estimator

    return {m.__name__: hashlib.sha256(Path(m.__file__).read_bytes()).hexdigest()[:12] for m in (estimator, budget)}


def setup_sim() -> None:
    """simcuda in place of the GPU: its Python launch-bound workload serves the jobs' protocol."""
    from gputrace import simcuda

    os.environ.update(simcuda.env())
    os.environ.setdefault("SIMCUDA_LAUNCH_NS", "2000")
    os.environ["GPUTRACE_BENCH_JOB_CMD"] = " ".join([*simcuda.workload("launch_bound_py"), "--serve"])
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def save(doc: dict, out: Path, raw: Path, pack: bool = False) -> None:
    """OUT/rates.json (after every step) and, with `pack`, OUT/raw.tar.xz (the reports and their
    observations: at the end, and before the switch job, so a call cut short keeps the standing jobs')."""
    (out / "rates.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if pack:
        tmp = out / "raw.tar.xz.tmp"
        with tarfile.open(tmp, "w:xz", preset=3) as tar:
            tar.add(raw, arcname="raw")
        tmp.rename(out / "raw.tar.xz")


def run(args: argparse.Namespace, out: Path, raw: Path) -> dict:
    t_start = time.monotonic()
    names = [n for n in args.jobs.split(",") if n]
    doc: dict = {"schema": SCHEMA, "device": device_name(args.sim), "commit": commit(), "options": vars(args),
                 "order": names, "jobs": {}, "exact": {}, "started": time.time(), "sources": sources()}
    switch = args.switch_eager > 0 and args.switch_graph > 0
    jobs, failed = start_jobs(names + (["switch"] if switch else []))
    doc["setup_s"] = time.monotonic() - t_start
    for n, why in failed.items():
        doc["jobs"].setdefault(n, {})["error"] = f"did not start: {why}"

    def left() -> float:
        return args.budget_s - (time.monotonic() - t_start)

    try:
        # Exact calls per step of each (the switch job's in each mode: it switches after its first phase).
        for n, j in jobs.items():
            for key in ([f"{n}-eager", f"{n}-graph"] if n == "switch" else [n]):
                try:
                    ex = audit_gpu.exact_counts(j, args.exact_s)
                except (SystemExit, Exception) as exc:  # noqa: BLE001 - one job's failure ends only its part
                    log(f"{key}: exact count failed: {exc}")
                    doc["jobs"].setdefault(n, {})["error"] = f"exact: {exc}"
                    break
                top = sorted(ex["calls_per_step"].items(), key=lambda kv: -kv[1])[:6]
                log(f"{key}: {ex['steps']} steps exact, {ex['traced_steps_per_s']:.0f}/s; calls/step "
                    f"{[(f, round(c, 1)) for f, c in top]}")
                if n == "switch":
                    doc["exact"][key] = ex
                else:
                    doc["jobs"].setdefault(n, {})["exact"] = ex
        if "switch" in jobs:
            jobs.pop("switch").close()
        save(doc, out, raw)
        reserve = (FROM_START_S + args.switch_eager + args.switch_graph) if switch else 0.0
        took: list[float] = []  # each attach's wall time, and a second: the next one's expected cost
        for r in range(args.attaches):
            for n, j in jobs.items():
                jd = doc["jobs"][n]
                if "exact" not in jd or jd.get("error"):
                    continue
                if left() - reserve < max([ATTACH_COST_S, *took]):
                    log(f"{n}: attach {r} left out ({left():.0f} s left, {reserve:.0f} s kept for the switch job)")
                    doc.setdefault("left_out", []).append(f"{n}-{r}")
                    continue
                t_at = time.monotonic()
                try:
                    at = one_attach(j, n, r, raw)
                    took.append(time.monotonic() - t_at + 1.0)
                except (SystemExit, Exception) as exc:  # noqa: BLE001
                    log(f"{n}: attach {r} failed: {exc}")
                    jd.setdefault("attach_errors", []).append(str(exc)[-1500:])
                    continue
                jd.setdefault("attaches", []).append(at)
                rows = rows_of({f: c * at["steps_per_s"] for f, c in jd["exact"]["calls_per_step"].items()},
                               at["rates"])
                log(f"{n} attach {r}: {at['steps_per_s']:.0f} steps/s over {at['span_s']:.2f} s, overhead "
                    f"{pct(at['tracer_overhead'], False)}%, covered {sum(x['covered'] for x in rows)}/{len(rows)}, "
                    "errors " + " ".join(f"{x['function']} {pct(x['rel_error'])}%" for x in rows))
                save(doc, out, raw)
    finally:
        for j in jobs.values():
            try:
                j.close()
            except OSError:
                j.proc.kill()
    save(doc, out, raw, pack=True)
    if switch and "switch-graph" in doc["exact"]:
        if left() < FROM_START_S + args.switch_eager + args.switch_graph - 10:
            log(f"switch: left out ({left():.0f} s left)")
        else:
            try:
                doc["switch"] = from_start(doc["exact"], raw, args.switch_eager, args.switch_graph,
                                           0 if args.sim else WARMUP)
                log(f"switch: ready after {doc['switch']['ready_s']:.1f} s traced; eager "
                    f"{doc['switch']['eager']['steps_per_s']:.0f}/s, graph {doc['switch']['graph']['steps_per_s']:.0f}/s")
            except (SystemExit, Exception) as exc:  # noqa: BLE001
                log(f"switch: failed: {exc}")
                doc["switch"] = {"error": str(exc)[-1500:]}
    doc["wall_s"] = time.monotonic() - t_start
    save(doc, out, raw, pack=True)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory of the results (on the GPU machine: $OUT)")
    ap.add_argument("--raw", help="where the attach reports go before they are packed (default OUT/raw)")
    ap.add_argument("--jobs", default=",".join(STANDING), help="standing jobs (bench/gpu_jobs.py)")
    ap.add_argument("--attaches", type=int, default=3, help="5-s attaches per standing job, as time allows")
    ap.add_argument("--exact-s", type=float, default=3.0, help="seconds of each exact count")
    ap.add_argument("--switch-eager", type=float, default=8.0, help="the from-start switch job's eager seconds (0: no switch job)")
    ap.add_argument("--switch-graph", type=float, default=8.0, help="its graph-replay seconds")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="stop starting attaches that would end past this many seconds from the start")
    ap.add_argument("--sim", action="store_true", help="simcuda's launch_bound.py --serve stands in for every job")
    ap.add_argument("--reanalyze", action="store_true", help="only the table again, from OUT/rates.json and OUT/raw")
    ap.add_argument("--reestimate", action="store_true", help="with --reanalyze: the rates worked out again")
    args = ap.parse_args()
    out = Path(args.out)
    raw = Path(args.raw) if args.raw else out / "raw"
    if args.reanalyze:
        doc = orjson.loads((out / "rates.json").read_bytes())
        if not raw.exists() and (out / "raw.tar.xz").exists():
            with tarfile.open(out / "raw.tar.xz") as tar:
                try:
                    tar.extractall(raw.parent, filter="data")
                except TypeError:  # (a Python without extraction filters)
                    tar.extractall(raw.parent)
    else:
        if args.sim:
            setup_sim()
        out.mkdir(parents=True, exist_ok=True)
        raw.mkdir(parents=True, exist_ok=True)
        doc = run(args, out, raw)
    res = analyze(doc, raw, args.reestimate)
    if not args.reanalyze:
        doc["analysis"] = res
        (out / "rates.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    errs = {n: j["error"] for n, j in doc["jobs"].items() if j.get("error")}
    if errs:
        log(f"failed: {errs}")
    if isinstance(doc.get("switch"), dict) and doc["switch"].get("error"):
        log(f"switch failed: {doc['switch']['error'][-300:]}")
    log(f"device {doc['device']}, commit {str(doc['commit'])[:10]}, wall {doc.get('wall_s', 0):.0f} s; "
        f"truth = exact calls/step x the job's steps over the attach's span; cov: |est - truth| <= stated 95%; "
        f"ratio err: (est/est of ref) / (exact ratio) - 1")
    text = totals(res) + [""] + table(res)
    if not args.reanalyze:
        (out / "table.txt").write_text("\n".join(text) + "\n")
    print("\n".join(text), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
