#!/usr/bin/env python3
"""docs/overhead-report.md and its plots, from committed results of GPU runs (no GPU needed).

The report as committed, one command (docs/overhead-report.md, docs/overhead-report/*.png):
    .venv/bin/python bench/overhead_report.py bench/results/overhead-h200 \\
        --audit bench/results/audit-validate-h100 --incremental bench/results/incremental-costs-h100-2 \\
        --restore-whole bench/results/restore-whole-h100.json --rates bench/results/rates-h100-7
Anywhere else:
    .venv/bin/python bench/overhead_report.py DIR [--audit D] [...] --md OUT.md --plots OUTDIR [--mtbf-h 24]

Every figure in the report is worked out here from the inputs' JSON:
  DIR (bench/overhead_suite.py --out): steady-JOB.json (a workload native, under the shim, under the
      tracer, under the emulated layer), ckpt-SIZE-STORAGE.json (bench/ckpt_costs_gpu.py), app-SIZE.json
      (bench/appckpt_gpu.py), and DIR/notes.json, a hand-written input: {"WORKLOAD": "why its prediction
      is off"}, quoted where the audit's bounds miss a measurement (a miss without a note says "not
      explained yet");
  --audit (bench/audit_validate.py --out): WORKLOAD.json, the audit against the emulated layer switched
      on and off in sub-second phases, read through audit_validate.summarize;
  --incremental (bench/incremental_costs_gpu.py): incremental-costs.json, incremental checkpoints and
      restores beside the driver's checkpoint of the same job;
  --restore-whole (bench/restore_whole_gpu.py): whole-process checkpoint/restore cycles;
  --rates (bench/rates_gpu.py): rates.json.xz, the tracer's rates against each job's exact calls.
An input not given, or a stage, workload or part its results lack, reads "not measured" with why.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import audit_gpu  # noqa: E402

# The shim's own cost a call, and what it wraps, as the audit's `shim` preset says (tracer/audit.py).
try:
    from gputrace.tracer.audit import INDIRECT_MAX, PRESETS
except ImportError:  # pragma: no cover - the repository's own venv has it
    raise SystemExit("overhead_report: gputrace is not importable: use .venv/bin/python")

NOT = "not measured"
SUB_ALL = {"submission": "submission calls", "all": "every class"}


def pct(x: float | None, digits: int = 1) -> str:
    return NOT if x is None else f"{100 * x:.{digits}f}%"


def ci_pct(m: dict | None, digits: int = 1) -> str:
    """median (lo..hi) of a median_ci dict."""
    if not m or m.get("median") is None:
        return NOT
    if m.get("lo") is None:
        return f"{100 * m['median']:.{digits}f}% (one phase)"
    return f"{100 * m['median']:.{digits}f}% ({100 * m['lo']:.{digits}f}..{100 * m['hi']:.{digits}f})"


def num(x: float | None, fmt: str = "{:.3g}") -> str:
    return NOT if x is None else fmt.format(x)


# --- the figures ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    lower: float | None
    upper: float | None

    def miss(self, x: float | None) -> float | None:
        """How far x lies outside [lower, upper] (0 inside); None where either is unknown."""
        if x is None or self.lower is None or self.upper is None:
            return None
        return max(0.0, self.lower - x, x - self.upper)


def shim_bounds(doc: dict) -> Bounds:
    """The audit's bounds for the shim itself (its `shim` preset: cost a call over the classes it
    wraps), over the rates of the workload's first 5-s attach, put at the shim phases' speed."""
    preset = PRESETS["shim"]
    classes = {c.value for c in preset.classes}
    pairs = doc.get("tracer_pairs") or []
    if not pairs:
        return Bounds(None, None)
    first = pairs[0]
    kinds = doc["exact"]["classes"]
    rate = sum(v[0] for n, v in first["rates"].items() if kinds.get(n) in classes and v[0] is not None)
    speed = first.get("session_steps_per_s")
    native = doc["shim"]["ref_steps_per_s"]
    if speed and native:
        rate *= (sum(native) / len(native)) / speed
    added = rate * preset.cost_ns * 1e-9
    wait = first.get("wait_s_per_s")
    return Bounds(None if wait is None else max(0.0, added - wait), added * INDIRECT_MAX)


def workload_figures(doc: dict) -> dict:
    """One workload's row: its calls and GPU time, and each layer's measured slowdown beside the
    audit's prediction."""
    a = audit_gpu.analyze(doc)
    per_step = sum(doc["exact"]["calls_per_step"].values())
    gpu = doc.get("gpu") or {}
    busy = gpu.get("gpu_busy_s_per_step")
    steps = doc["shim"]["ref_steps_per_s"]
    native_sps = sum(steps) / len(steps) if steps else None
    tracer = a["tracer"].get("5.0") or a["tracer"].get("5") or {}
    sb = shim_bounds(doc)
    shim = doc["shim"]["slowdown"]
    emu = []
    for e in a["emulation"]:
        b = Bounds(e["predicted_lower"], e["predicted_upper"])
        emu.append({"cost_ns": e["cost_ns"], "selection": e["selection"], "measured": e["measured"],
                    "measured_ci": e.get("measured_ci"), "lower": b.lower, "upper": b.upper,
                    "miss": b.miss(e["measured"]), "intercepted_hz": e["intercepted_hz"],
                    # Where the run has the same layer at cost 0: its floor (the layer's own clock reads
                    # and counters), and the measurement less it, against the same bounds.
                    "floor": e.get("floor"), "over_floor": e.get("over_floor"),
                    "over_floor_miss": b.miss(e.get("over_floor")),
                    "intercepted_per_gpu_ms": None if not busy or not native_sps else
                    e["intercepted_hz"] / (native_sps * busy * 1e3)})
    rates = a["rates_by_length"].get("5.0") or a["rates_by_length"].get("5") or {}
    return {
        "job": doc["job"], "device": doc.get("device"), "commit": doc.get("commit"),
        "calls_per_step": per_step, "gpu_ms_per_step": None if busy is None else busy * 1e3,
        "gpu_error": gpu.get("error") if gpu else "the job gave no GPU time",
        "gpu_simulated": bool(gpu.get("simulated")),
        "calls_per_gpu_ms": None if not busy else per_step / (busy * 1e3),
        "native_steps_per_s": native_sps,
        "gpu_share": None if not busy or not native_sps else busy * native_sps,
        "control": doc["control"]["slowdown"], "shim": shim, "shim_lower": sb.lower, "shim_upper": sb.upper,
        "shim_miss": sb.miss(shim.get("median")),
        "tracer": tracer.get("slowdown_steps") or tracer.get("slowdown"), "tracer_accounted": tracer.get("accounted"),
        "rates_within_10pct": rates.get("within_10pct"), "rates_pairs": rates.get("pairs"),
        "rates_covered": rates.get("covered"),
        "wait_s_per_s": (doc.get("tracer_pairs") or [{}])[0].get("wait_s_per_s"),
        "emulation": emu,
    }


def shim_like_control(r: dict) -> bool:
    """The shim's slowdown interval meets the control's: what the shim costs is below what two
    native processes of the job differ by, and no bound can be checked against it."""
    a, b = r["shim"], r["control"]
    if not a or not b or None in (a.get("lo"), a.get("hi"), b.get("lo"), b.get("hi")):
        return False
    return a["lo"] <= b["hi"] and b["lo"] <= a["hi"]


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return None if not sx or not sy else sxy / (sx * sy)


def tracks(rows: list[dict]) -> list[str]:
    """Does the cost track driver calls per GPU time (the published explanation)? The rank
    correlation across workloads, for each emulated cost and selection."""
    out = []
    for c, sel in sorted({(e["cost_ns"], e["selection"]) for r in rows for e in r["emulation"] if e["cost_ns"] > 0}):
        pts = [(e["intercepted_per_gpu_ms"], e["measured"]) for r in rows for e in r["emulation"]
               if e["cost_ns"] == c and e["selection"] == sel and e["intercepted_per_gpu_ms"] and e["measured"] is not None]
        rho = spearman([p[0] for p in pts], [p[1] for p in pts])
        out.append(f"- {c / 1000:g} µs a call, {SUB_ALL[sel]}: over {len(pts)} workloads, "
                   + ("too few to rank." if rho is None else f"Spearman's rank correlation of slowdown with "
                      f"intercepted calls per GPU-ms {rho:+.2f}."))
    if not out:
        return []
    return ["Does the cost track driver calls per GPU time, as the published explanation has it?", "", *out, ""]


def load(d: Path) -> dict:
    def docs(prefix: str) -> list[dict]:
        return [orjson.loads(p.read_bytes()) for p in sorted(d.glob(f"{prefix}-*.json"))
                if not p.name.endswith(".obs.json") and "-attach-" not in p.name]

    notes_f = d / "notes.json"
    every = {k: docs(k) for k in ("steady", "ckpt", "app")}
    failed = [x for v in every.values() for x in v if x.get("failed")]
    return {"steady": [x for x in every["steady"] if not x.get("failed")],
            "ckpt": [x for x in every["ckpt"] if not x.get("failed")],
            "app": [x for x in every["app"] if not x.get("failed")], "failed": failed,
            "notes": orjson.loads(notes_f.read_bytes()) if notes_f.exists() else {}}


def failure_rows(app: dict, mtbf_h: float) -> list[dict]:
    """Each method's expected work lost per failure at a checkpoint interval that keeps its cost at
    1% (bench/failure_model.py); a method that writes in the background cannot checkpoint more often
    than its write completes."""
    import failure_model as fm

    rows = []
    model = fm.FailureModel(mtbf_h=mtbf_h)
    for name, m in (app.get("methods") or {}).items():
        if not isinstance(m, dict):
            continue
        held, resume = m.get("held_s"), m.get("resume_s")
        costs = fm.CheckpointCosts(held_s=held, resume_s=resume,
                                   write_s=m.get("write_s") if m.get("background_write") else None,
                                   step_s=app.get("step_s"))
        reason = m.get("error") or m.get("skipped") or m.get("held_s_reason") or m.get("resume_s_reason")
        rows.append({"method": name, "held_s": held, "resume_s": resume, "bytes": m.get("bytes"),
                     "plan": fm.expected(costs, model), "error": reason})
    return rows


# --- the other committed inputs -----------------------------------------------------------------------------

# Where a run's JSON names no commit, or names the device copy's HEAD rather than the tree that ran, the tree
# as the README committed beside the results gives it (keyed by the input's name). Hand-written, like notes.json.
README_TREES = {
    "audit-validate-h100": ("375d37a", "its README: gputrace from a wheel of that tree; the JSON's commit, "
                                       "5268b9d, is what the device's copy of the repository reported"),
    "incremental-costs-h100": ("375d37a", "its README: gputrace from a wheel of that tree; the JSON names no commit"),
    "rates-h100-4": ("dc8f35c", "its README: that working tree laid over the wheel; the JSON's commit, 5268b9d, "
                                "is what the device's copy reported"),
    "rates-h100-6": ("95f2845", "its README: that working tree laid over the wheel, the estimator of 39e0052; the "
                                "JSON's commit, cc84b66, is what the device's copy reported"),
    "rates-h100-7": ("eaf47c2", "its README: that working tree laid over the wheel; the JSON's commit, e03c429, "
                                "is what the device's copy reported"),
}
# The suite's steady state waits on other work (issue 41, part 2): said wherever its stages are missing.
STEADY_WHY = ("issue 41 runs them after the tracer-rates issue (38) and the audit-bounds issue (40) are resolved, "
              "at that code; neither is yet, so none has run at the current code")


def short(c: str | None) -> str:
    return NOT if not c else str(c)[:10]


def code_of(name: str, recorded: str | None, note: str | None = None) -> str:
    """The code a run was made from: the README's tree where README_TREES names one, else the JSON's."""
    if name in README_TREES:
        tree, why = README_TREES[name]
        return f"{tree} ({why})"
    if recorded and note:
        return f"{short(recorded)} ({note})"
    return short(recorded) if recorded else f"{NOT} (the JSON names no commit)"


def load_audit(d: Path | None) -> dict | None:
    """bench/audit_validate.py's results: its summary's rows, made again from the workloads' files."""
    if d is None:
        return None
    import audit_validate

    if not d.is_dir():
        return {"dir": d, "rows": [], "missing": list(audit_validate.WORKLOADS), "failed": [], "config": {}}
    rows = audit_validate.summarize(d)["rows"]
    have = {r["workload"] for r in rows}
    cfg = {}
    for w in audit_validate.WORKLOADS:
        f = d / f"{w}.json"
        if f.exists() and not cfg:
            cfg = orjson.loads(f.read_bytes()).get("config") or {}
    return {"dir": d, "rows": [r for r in rows if "failed" not in r], "config": cfg,
            "failed": [r for r in rows if "failed" in r],
            "missing": [w for w in audit_validate.WORKLOADS if w not in have]}


def load_json(p: Path | None, inside: str | None = None) -> dict | None:
    """A results file (or the named file inside a results folder); {} where it is absent."""
    if p is None:
        return None
    if p.is_dir() and inside:
        p = p / inside
    if not p.exists():
        return {}
    raw = p.read_bytes()
    if p.suffix == ".xz":
        import lzma

        raw = lzma.decompress(raw)
    return orjson.loads(raw)


def rates_counts(doc: dict) -> dict | None:
    """The tracer's rates against the truth (each job's exact calls a step x its steps a second while
    attached), every (attach, function) pair above 1k calls/s: known, inside their 95% intervals,
    within 10%, not known."""
    if not doc or not doc.get("jobs"):
        return None
    out = {"jobs": [], "pairs": 0, "known": 0, "inside": 0, "within_10pct": 0, "not_known": 0, "attaches": 0}
    for j in doc.get("order") or list(doc["jobs"]):
        jd = doc["jobs"][j]
        cps = (jd.get("exact") or {}).get("calls_per_step") or {}
        for a in jd.get("attaches") or []:
            sps, nk = a.get("steps_per_s"), set(a.get("not_known") or [])
            if not sps:
                continue
            out["attaches"] += 1
            for f, c in cps.items():
                truth = c * sps
                if truth <= 1000:
                    continue
                out["pairs"] += 1
                r = (a.get("rates") or {}).get(f)
                if f in nk or not r or r[0] is None:
                    out["not_known"] += 1
                    continue
                out["known"] += 1
                out["within_10pct"] += abs(r[0] / truth - 1) <= 0.10
                out["inside"] += r[1] is not None and abs(r[0] - truth) <= r[1]
        out["jobs"].append(j)
    return out


def sources(data: dict, ext: dict) -> list[str]:
    """Where each section's figures come from: the input, its device and the code it ran."""
    rows = []
    suite = data["steady"] + data["ckpt"] + data["app"]
    if suite:
        devs = sorted({str(x.get("device")) for x in suite})
        commits = sorted({short(x.get("commit")) for x in suite})
        rows.append((f"`{ext['dir']}`", "the suite's stages: " + ", ".join(sorted(stage_names(data))),
                     ", ".join(devs), ", ".join(commits)))
    a = ext.get("audit")
    if a and a["rows"]:
        r0 = a["rows"][0]
        rows.append((f"`{a['dir']}`", "the audit against the emulated layer, sub-second alternation (bench/audit_validate.py)",
                     str(r0.get("device")), code_of(Path(a["dir"]).name, r0.get("commit"))))
    inc = ext.get("incremental")
    if inc:
        rows.append((f"`{ext['incremental_path']}`", "incremental checkpoints and restores, the driver's checkpoint "
                     "of the same job (bench/incremental_costs_gpu.py)", str(inc.get("device")),
                     code_of(Path(ext["incremental_path"]).name, inc.get("commit"))))
    rw = ext.get("restore_whole")
    if rw:
        rows.append((f"`{ext['restore_whole_path']}`", "whole-process checkpoint/restore cycles from `gputrace top` "
                     "(bench/restore_whole_gpu.py)", str(rw.get("device")),
                     code_of(Path(ext["restore_whole_path"]).stem, rw.get("commit"), rw.get("commit_note"))))
    rt = ext.get("rates")
    if rt:
        rows.append((f"`{ext['rates_path']}`", "the tracer's rates against each job's exact calls (bench/rates_gpu.py)",
                     str(rt.get("device")), code_of(Path(ext["rates_path"]).name, rt.get("commit"))))
    if not rows:
        return []
    return ["## Where the figures come from", "",
            "| input | what | device | code |", "|---|---|---|---|",
            *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows], ""]


def stage_names(data: dict) -> set[str]:
    out = set()
    for x in data["steady"]:
        out.add(f"steady:{x.get('job')}")
    for c in data["ckpt"]:
        out.add(f"ckpt:{c.get('size', c.get('size_gib'))}:{c.get('storage')}")
    for a in data["app"]:
        out.add(f"app:{a.get('size')}")
    for f in data["failed"]:
        out.add(str(f.get("stage")))
    return out


def missing_stages(data: dict) -> dict[str, list[str]]:
    """The suite's stages with no result in DIR, by kind."""
    import overhead_suite

    have = stage_names(data)
    out: dict[str, list[str]] = {}
    for st in overhead_suite.stages():
        if st.name not in have:
            out.setdefault(st.kind, []).append(st.name)
    return out


def audit_section(a: dict | None, plot_rel: str, made: list[Path]) -> list[str]:
    L = ["## The audit's prediction beside the measured slowdown", ""]
    if a is None or not a["rows"]:
        why = ("no audit-validation results given (--audit DIR, bench/audit_validate.py's)" if a is None
               else f"no workload's results in {a['dir']}")
        return L + [f"Not measured: {why}.", ""]
    cfg = a["config"]
    costs = ", ".join(f"{c / 1000:g}" for c in cfg.get("costs_ns") or sorted({r["cost_ns"] for r in a["rows"]}))
    L += ["Each workload ran as one warm process under the shim. Its emulated layer (busy CPU time added to each "
          "call of the functions the audit's `shim` preset counts) was switched on and off over the control "
          f"socket in sub-second phases, {costs} µs a call interleaved in a seeded order; each phase with the "
          "layer on is held against the mean rate of its two neighbours without it, and the slowdown is the "
          "median of those pairs with its 95% interval (seeded bootstrap). The audit's bounds come from a "
          f"{num(cfg.get('attach_s'), '{:g}')}-s `gputrace attach -p` of the same process with the layer off "
          "(the rates it read and each calling thread's slack), worked out at each cost; beside them, the same "
          "bounds with the rates' 95% intervals. *Inside*: the measured median within the bounds, within 1 point. "
          "The last column is the layer's true added time (the calls the shim says it slowed, times the cost, a "
          "second) with the bounds worked out at it.", ""]
    rows = a["rows"]
    inside = sum(1 for r in rows if r.get("inside_point"))
    resolved = sum(1 for r in rows if r.get("resolved"))
    lower0 = sum(1 for r in rows if r.get("lower") == 0)
    L += [f"- Inside the bounds within 1 point: **{inside} of {len(rows)}** (workload, cost) pairs.",
          f"- Medians whose 95% interval is within ±1 point: {resolved} of {len(rows)} (the rest had too little "
          "time for it in one device call).",
          f"- Lower bound 0 (the calling threads' slack exceeds what the layer adds): {lower0} of {len(rows)} pairs"
          + (f"; at every cost for {', '.join(zero)}." if (zero := [w for w in dict.fromkeys(r['workload'] for r in rows)
                                                              if all(r['lower'] == 0 for r in rows if r['workload'] == w)])
             else "."), ""]
    if any(p.name == "audit-vs-measured.png" for p in made):
        L += [f"![the audit's bounds and the measured slowdown]({plot_rel}/audit-vs-measured.png)", ""]

    def sp(x):
        return NOT if x is None else f"{100 * x:+.1f}%"

    yes = {True: "yes", False: "**no**", None: NOT}
    L += ["| workload | layer | measured (95% interval) | pairs x phase | audit's bounds | with the rates' intervals | inside | the layer's true added time: bounds, inside |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = r.get("ci") or [None, None]
        inter = "" if ci[0] is None else f" ({sp(ci[0])}..{sp(ci[1])})"
        true = NOT if r.get("true_added") is None else (
            f"{sp(r['true_added'])}: {sp(r.get('true_rate_lower'))}..{sp(r.get('true_rate_upper'))}, "
            f"{yes[r.get('inside_at_true_rate')]}")
        L.append(f"| {r['workload']} | {r['cost_ns'] / 1000:g} µs | {sp(r['measured'])}{inter} | "
                 f"{r['pairs']} x {1000 * r['phase_s']:.0f} ms | {sp(r['lower'])}..{sp(r['upper'])} | "
                 f"{sp(r.get('lower_min'))}..{sp(r.get('upper_max'))} | {yes[r.get('inside_point')]} | {true} |")
    for r in a["failed"]:
        L.append(f"| {r['workload']} | every cost | not measured: failed: {r['failed']} | | | | | |")
    for w in a["missing"]:
        L.append(f"| {w} | every cost | not measured: no {w}.json in {a['dir']} | | | | | |")
    L += ["", "Driver calls per GPU-ms (whether the cost tracks them) are not measured here: this run timed no "
          "GPU work; the suite's steady:* stages do (PyTorch's profiler), and they have not run (below).", ""]
    return L


def steady_missing_section(data: dict, rates: dict | None, rates_path: str | None) -> list[str]:
    """What the suite's steady:* stages would measure and why they have not."""
    miss = missing_stages(data).get("steady", [])
    if not miss:
        return []
    L = ["## Running under the layer: the suite's steady state", "",
         f"Not measured: {', '.join(miss)}. These stages give each workload's shim against a second native "
         "process (the control), the tracer at its default budget against what it accounted, and driver calls "
         f"per GPU-ms. Why: {STEADY_WHY}.", ""]
    c = rates_counts(rates) if rates else None
    if c:
        L += [f"Where the tracer's rates stood at their last GPU run (`{rates_path}`, {rates.get('device')}): "
              f"{c['attaches']} attaches of {', '.join(c['jobs'])}, {c['pairs']} (attach, function) pairs above "
              f"1k calls/s: {c['known']} known ({c['inside']} inside their stated 95% intervals, "
              f"{c['within_10pct']} within ±10% of the truth), {c['not_known']} not known.", ""]
    elif rates is not None:
        L += ["The tracer's rates: not measured (no rates results in the input given).", ""]
    return L


def incremental_section(inc: dict | None, path: str | None, plot_rel: str, made: list[Path]) -> list[str]:
    L = ["### Incremental checkpoints and restores, and the driver's checkpoint of the same job", ""]
    if not inc:
        why = "no results given (--incremental)" if inc is None else f"no incremental-costs.json in {path}"
        return L + [f"Not measured: {why}.", ""]
    L += ["One PyTorch job a size and storage (`bench/ckpt_job.py` under `gputrace run --checkpointable`): a "
          "whole checkpoint, then for each share changed an incremental `checkpoint --since` the whole one and "
          "`restore --device-only --force` of it, and last NVIDIA's driver checkpoint of the same process "
          "(`checkpoint --backend driver`: cuCheckpointProcess lock, checkpoint into the process's host "
          "memory, restore, unlock; nothing stored). *Freeze*: the job stopped; *total*: the checkpoint "
          "command's own total (interpreter start-up not included); *target*: the bytes stored over a plain "
          "fsynced write's rate there (bytes read over a cold read's for the restore); *back*: the restore's "
          "start to the job running with the data back; *right*: the job's checksum after the restore.", ""]
    if any(p.name == "incremental-vs-driver.png" for p in made):
        L += [f"![freeze: incremental, whole, driver]({plot_rel}/incremental-vs-driver.png)", ""]
    L += ["| size | storage | checkpoint | freeze ms | total s | target s | restore freeze ms | back s | target s | right |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    right = {True: "yes", False: "**no**", None: NOT}
    for part in inc.get("parts") or []:
        size = f"{part['size']} {inc.get('unit', 'GiB')}"
        plain = part.get("plain") or {}
        w = part.get("whole") or {}
        if w:
            L.append(f"| {size} | {part['storage']} | whole | {num(w.get('freeze_ns') and w['freeze_ns'] / 1e6, '{:.1f}')} | "
                     f"{num(w.get('total_ns') and w['total_ns'] / 1e9, '{:.3g}')} | "
                     f"{num(plain.get('write_gb_s') and w.get('stored_bytes', 0) / (plain['write_gb_s'] * 1e9), '{:.3g}')} "
                     f"| | | | |")
        for ch in part.get("changes") or []:
            s = ch.get("summary") or {}
            if not s:
                L.append(f"| {size} | {part['storage']} | {ch.get('pct'):g}% changed | not measured: "
                         f"{ch.get('error') or 'no summary'} | | | | | | |")
                continue
            L.append(f"| {size} | {part['storage']} | {ch['pct']:g}% changed | {1e3 * s['freeze_s']:.1f} | "
                     f"{s['total_s']:.3g} | {s['target_checkpoint_s']:.3g} | {1e3 * s['restore_freeze_s']:.1f} | "
                     f"{s['back_s']:.3g} | {s['target_restore_s']:.3g} | {right[ch.get('data_right')]} |")
        dr = part.get("driver") or {}
        if dr.get("freeze_ns"):
            L.append(f"| {size} | {part['storage']} | driver (lock to unlock) | {dr['freeze_ns'] / 1e6:.1f} | "
                     f"{dr['checkpoint_ns'] / 1e9:.2f} (its checkpoint) | | | {dr['restore_ns'] / 1e9:.2f} (its restore) | "
                     f"| {right[dr.get('data_right')]} |")
        else:
            L.append(f"| {size} | {part['storage']} | driver | not measured: {dr.get('error') or 'no result'} | | | | | | |")
    L.append("")
    for part in inc.get("parts") or []:
        dr = (part.get("driver") or {}).get("freeze_ns")
        one = next((c["summary"] for c in part.get("changes") or [] if c.get("pct") == 1.0 and c.get("summary")), None)
        w = (part.get("whole") or {}).get("freeze_ns")
        if dr and one:
            L.append(f"- {part['size']} {inc.get('unit', 'GiB')}, {part['storage']}: the driver held the job "
                     f"{dr / 1e9:.2f} s; the incremental at 1% changed froze it {1e3 * one['freeze_s']:.1f} ms "
                     f"({dr / 1e9 / one['freeze_s']:.0f}x shorter)"
                     + (f", the whole checkpoint {w / 1e6:.0f} ms ({dr / w:.0f}x shorter)" if w else "")
                     + (f"; the whole checkpoint's total of {tot / 1e9:.1f} s holds {setup / 1e9:.2f} s of set-up "
                        "(its image mapped and pinned), an incremental's "
                        f"{1e6 * one['setup_s']:.0f} µs." if (tot := (part.get('whole') or {}).get('total_ns'))
                        and (setup := (part.get('whole') or {}).get('setup_ns')) and one.get('setup_s') is not None
                        else "."))
    L.append("")
    return L + suspend_lines(inc.get("suspend") or [], inc.get("unit", "GiB"))


def suspend_lines(sizes: list[dict], unit: str) -> list[str]:
    """Suspend and resume, cycle after cycle (`bench/incremental_costs_gpu.py --parts suspend`): the first
    cycle makes the job's image (mapped and pinned, kept after), the others reuse it."""
    if not any(sz.get("cycles") for sz in sizes):
        return ["Suspend and resume (`bench/incremental_costs_gpu.py --parts suspend`): not measured: that part "
                "was not run in these results.", ""]
    L = ["Suspend and resume of one job, cycle after cycle: *suspend* the command's total (its copies off the GPU, "
         "the memory released), *resume* the same back; *over the copies*: both totals less both copies. The "
         "first cycle makes the job's image (host memory mapped and pinned, then kept for the next).", "",
         "| size | cycle | suspend s | of it: set-up s | copy s | resume s | over the copies s | right |",
         "|---|---|---|---|---|---|---|---|"]
    right = {True: "yes", False: "**no**", None: NOT}
    for sz in sizes:
        for c in sz.get("cycles") or []:
            s = c.get("summary") or {}
            if not s:
                L.append(f"| {sz['size']} {unit} | {c.get('cycle')} | not measured: {c.get('error') or 'no summary'} "
                         "| | | | | |")
                continue
            L.append(f"| {sz['size']} {unit} | {c['cycle']} | {s['suspend_total_s']:.3f} | {s['suspend_setup_s']:.3f} | "
                     f"{s['suspend_copy_s']:.3f} | {s['resume_total_s']:.3f} | {s['over_copies_s']:.3f} | "
                     f"{right[c.get('data_right')]} |")
    return L + [""]


def restore_whole_section(rw: dict | None, path: str | None) -> list[str]:
    L = ["### Whole-process checkpoints and restores from `gputrace top`, cycle after cycle", ""]
    if not rw:
        why = "no results given (--restore-whole)" if rw is None else f"{path} holds no results"
        return L + [f"Not measured: {why}.", ""]
    L += ["Each job started as a user would (`gputrace run --checkpointable`), driven through `gputrace top`'s "
          "keys: a whole-process checkpoint (the shim's part, NVIDIA's driver checkpoint of what is left, CRIU's "
          "dump), the job left running, and a few steps later the running process replaced by the checkpoint's. "
          "After every restore the job's log is compared with an uninterrupted run's. Medians, with ranges.", "",
          "| job | cycles | alive after every restore | equal after every restore | freeze s | of it: driver checkpoint s | of it: CRIU dump s | held in all s | back s | of it: CRIU restore s | of it: driver restore s | image GB |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "**no**", None: NOT}
    for name, j in (rw.get("jobs") or {}).items():
        s = j.get("summary") or {}
        if not s:
            L.append(f"| {name} | not measured: {'; '.join(map(str, j.get('errors') or [])) or 'no summary'} | | | | | | | | | | |")
            continue

        def ms(k, rng=None):
            v = s.get(k)
            if v is None:
                return NOT
            r = s.get(rng) if rng else None
            return f"{v / 1e3:.2f}" + (f" ({r[0] / 1e3:.2f}-{r[1] / 1e3:.2f})" if r else "")

        L.append(f"| {name} | {s.get('cycles')} | {yes[s.get('alive_after_every_restore')]} | "
                 f"{yes[s.get('equal_after_every_restore')]} | {ms('freeze_ms_median', 'freeze_ms_range')} | "
                 f"{ms('driver_checkpoint_ms_median')} | {ms('criu_dump_ms_median')} | {ms('held_ms_median')} | "
                 f"{ms('back_ms_median', 'back_ms_range')} | {ms('criu_restore_ms_median')} | "
                 f"{ms('driver_restore_ms_median')} | {num(s.get('image_bytes_median') and s['image_bytes_median'] / 1e9, '{:.2f}')} |")
    L.append("")
    return L


def ckpt_vs_driver(ckpt: list[dict]) -> list[str]:
    """The suite's checkpoint stages, gputrace's freeze against the driver's and the whole process's."""
    out = []
    for c in sorted(ckpt, key=lambda c: (c.get("size_gib", 0), str(c.get("storage")))):
        if c.get("skipped"):
            continue
        p = c.get("paths") or {}
        g, d, f = (p.get(k) if isinstance(p.get(k), dict) else {} for k in ("gputrace", "driver", "full"))
        if g.get("freeze_s") and d.get("freeze_s"):
            out.append(f"| {c.get('size', c.get('size_gib'))} {c.get('size_unit', 'GiB')} | {c.get('storage')} | "
                       f"{g['freeze_s']:.3g} | {d['freeze_s']:.3g} | {d['freeze_s'] / g['freeze_s']:.0f}x | "
                       f"{num(f.get('freeze_s'))} | {num(f.get('driver_checkpoint_s'))} |")
    if not out:
        return []
    return ["gputrace's freeze against the driver's on the same job and size (the driver's: lock to unlock, its "
            "restore included, since the job is stopped throughout), and the whole process's (gputrace's part, "
            "the driver's checkpoint of what is left, CRIU's dump):", "",
            "| size | storage | gputrace freeze s | driver freeze s | driver / gputrace | whole-process freeze s | of it: driver checkpoint s |",
            "|---|---|---|---|---|---|---|", *out, ""]


# --- the plots -----------------------------------------------------------------------------------------------


def plots(rows: list[dict], ckpt: list[dict], app: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []

    def save(fig, path: Path) -> None:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    # 1. slowdown against driver calls per GPU-ms, the model's line for each cost drawn in.
    # On log axes a slowdown at or below 0 has no place: left out and counted in the title, not
    # drawn as a small positive one (the tables give every row).
    pts = [(r, e) for r in rows for e in r["emulation"]
           if e["cost_ns"] > 0 and e["intercepted_per_gpu_ms"] and e["measured"] is not None and e["measured"] > 0]
    not_drawn = sum(1 for r in rows for e in r["emulation"]
                    if e["cost_ns"] > 0 and e["intercepted_per_gpu_ms"] and e["measured"] is not None and e["measured"] <= 0)
    if pts:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        costs = sorted({e["cost_ns"] for _, e in pts})
        xs = [e["intercepted_per_gpu_ms"] for _, e in pts]
        lo, hi = min(xs) / 2, max(xs) * 2
        for i, c in enumerate(costs):
            color = f"C{i}"
            for sel, marker in (("submission", "o"), ("all", "s")):
                mine = [(e["intercepted_per_gpu_ms"], e["measured"]) for _, e in pts
                        if e["cost_ns"] == c and e["selection"] == sel]
                if mine:
                    ax.scatter(*zip(*mine), color=color, marker=marker,
                               label=f"{c / 1000:g} us a call, {SUB_ALL[sel]}")
            # The model with nothing hiding the layer and the step all GPU time: the added CPU time
            # per GPU time, x calls a GPU-ms x c.
            ax.plot([lo, hi], [lo * c * 1e-6, hi * c * 1e-6], color=color, lw=1, ls="--")
        for r, e in pts:
            if e["cost_ns"] == costs[-1] and e["selection"] == "submission":
                ax.annotate(r["job"], (e["intercepted_per_gpu_ms"], e["measured"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("intercepted driver calls per GPU-millisecond")
        ax.set_ylabel("measured slowdown (emulated layer)")
        ax.set_title("Slowdown against calls per GPU-ms; dashed: calls x cost per GPU time"
                     + (f"\n({not_drawn} at or below 0 not drawn)" if not_drawn else ""), fontsize=10)
        ax.legend(fontsize=7)
        save(fig, out / "slowdown-vs-calls-per-gpu-ms.png")

    # 2. prediction against measurement: the audit's bounds as a bar at each measured slowdown.
    pe = [(r, e) for r in rows for e in r["emulation"]
          if e["cost_ns"] > 0 and e["lower"] is not None and e["measured"] is not None]
    if pe:
        fig, ax = plt.subplots(figsize=(6, 6))
        top = max(max(e["upper"], e["measured"]) for _, e in pe) * 1.1 or 1.0
        ax.plot([0, 100 * top], [0, 100 * top], color="grey", lw=1)
        for _, e in pe:
            color = "C0" if e["miss"] is not None and e["miss"] <= 0.01 else "C3"
            ax.vlines(100 * e["measured"], 100 * e["lower"], 100 * e["upper"], color=color, lw=2)
        ax.set_xlabel("measured slowdown, %")
        ax.set_ylabel("the audit's bounds, %")
        ax.set_title("Prediction against measurement (red: outside by more than a point)")
        save(fig, out / "prediction-vs-measurement.png")

    # 3. freeze time against size, the bus limit drawn in.
    fr = [(c, name, p) for c in ckpt if not c.get("skipped") for name, p in (c.get("paths") or {}).items()
          if isinstance(p, dict) and p.get("freeze_s") is not None]
    if fr:
        fig, ax = plt.subplots(figsize=(7, 5))
        names = sorted({n for _, n, _ in fr})
        for i, n in enumerate(names):
            for storage, marker in (("tmpfs", "o"), ("disk", "^")):
                mine = sorted((c["size_gib"], p["freeze_s"]) for c, nn, p in fr if nn == n and c.get("storage") == storage)
                if mine:
                    ax.plot(*zip(*mine), marker=marker, color=f"C{i}", label=f"{n}, {storage}")
        limits = [c.get("limits", {}).get("d2h_gb_s") for c in ckpt if c.get("limits", {}).get("d2h_gb_s")]
        if limits:
            gbs = max(limits)
            sizes = sorted({c["size_gib"] for c, _, _ in fr})
            ax.plot(sizes, [s * (1 << 30) / (gbs * 1e9) for s in sizes], color="black", ls=":",
                    label=f"bus limit ({gbs:.0f} GB/s device to host)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GiB on the GPU")
        ax.set_ylabel("freeze, s")
        ax.set_title("Checkpoint freeze against size")
        ax.legend(fontsize=7)
        save(fig, out / "freeze-vs-size.png")

    # 4. application level against system level: time held and time to resume.
    bars = [(a.get("size"), n, m) for a in app for n, m in (a.get("methods") or {}).items()
            if isinstance(m, dict) and (m.get("held_s") is not None or m.get("resume_s") is not None)]
    if bars:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = [f"{n}\n({s})" for s, n, _ in bars]
        x = range(len(bars))
        # A figure not measured gets no bar (not one of height 0).
        for off, key, label in ((-0.2, "held_s", "job held, s"), (0.2, "resume_s", "to resume, s")):
            have = [(i, m[key]) for i, (_, _, m) in enumerate(bars) if m.get(key) is not None]
            ax.bar([i + off for i, _ in have], [v for _, v in have], width=0.4, label=label)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_title("Application-level against system-level checkpoints (a missing bar: not measured)")
        ax.legend(fontsize=8)
        save(fig, out / "app-vs-system.png")
    return made


def ext_plots(ext: dict, out: Path) -> list[Path]:
    """The audit's bounds beside the measured slowdown; the incremental freezes beside the driver's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[Path] = []
    a = ext.get("audit")
    if a and a["rows"]:
        out.mkdir(parents=True, exist_ok=True)
        costs = sorted({r["cost_ns"] for r in a["rows"]})
        works = list(dict.fromkeys(r["workload"] for r in a["rows"]))
        fig, axes = plt.subplots(1, len(costs), figsize=(4 * len(costs), 4.5), squeeze=False)
        for ax, c in zip(axes[0], costs):
            for i, w in enumerate(works):
                r = next((r for r in a["rows"] if r["workload"] == w and r["cost_ns"] == c), None)
                if r is None:
                    continue
                if r["lower"] is not None and r["upper"] is not None:
                    ax.bar(i, 100 * (r["upper"] - r["lower"]), bottom=100 * r["lower"], width=0.6, color="C0",
                           alpha=0.3, label="the audit's bounds" if i == 0 else None)
                if r["measured"] is not None:
                    ci = r.get("ci") or [None, None]
                    err = None if ci[0] is None else [[100 * (r["measured"] - ci[0])], [100 * (ci[1] - r["measured"])]]
                    ax.errorbar(i, 100 * r["measured"], yerr=err, fmt="o", color="C3" if not r.get("inside_point") else "black",
                                ms=4, capsize=3, label="measured (95% interval)" if i == 0 else None)
            ax.set_xticks(range(len(works)))
            ax.set_xticklabels(works, fontsize=8, rotation=30)
            ax.set_title(f"{c / 1000:g} us a call", fontsize=10)
            ax.set_ylabel("slowdown, %")
        axes[0][0].legend(fontsize=7)
        fig.suptitle("The audit's prediction and the measured slowdown (emulated layer, sub-second phases)", fontsize=10)
        fig.tight_layout()
        path = out / "audit-vs-measured.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    inc = ext.get("incremental")
    parts = [pt for pt in (inc or {}).get("parts") or [] if (pt.get("driver") or {}).get("freeze_ns")]
    if parts:
        out.mkdir(parents=True, exist_ok=True)
        labels = [f"{pt['size']} {inc.get('unit', 'GiB')}\n{pt['storage']}" for pt in parts]
        series = [(f"incremental, {pct_:g}% changed", [next((c["summary"]["freeze_s"] for c in pt["changes"]
                                              if c.get("pct") == pct_ and c.get("summary")), None) for pt in parts])
                  for pct_ in sorted({c["pct"] for pt in parts for c in pt.get("changes") or []})]
        series.append(("whole checkpoint", [(pt.get("whole") or {}).get("freeze_ns", 0) / 1e9 or None for pt in parts]))
        series.append(("driver (lock to unlock)", [pt["driver"]["freeze_ns"] / 1e9 for pt in parts]))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(series)
        for k, (name, ys) in enumerate(series):
            have = [(i, y) for i, y in enumerate(ys) if y]
            ax.bar([i - 0.4 + width * (k + 0.5) for i, _ in have], [y for _, y in have], width=width, label=name,
                   color=f"C{k}")
        ax.set_xticks(range(len(parts)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("job stopped, s")
        ax.set_title("Freeze: gputrace's incremental and whole checkpoints against the driver's, same job", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / "incremental-vs-driver.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


# --- the report ----------------------------------------------------------------------------------------------


def fm_assumptions(mtbf_h: float) -> str:
    import failure_model as fm

    return fm.assumptions(fm.FailureModel(mtbf_h=mtbf_h))


def render(data: dict, ext: dict, plot_rel: str, made: list[Path], mtbf_h: float, command: str) -> str:
    rows = [workload_figures(doc) for doc in data["steady"]]
    a = ext.get("audit")
    devices = sorted({str(r["device"]) for r in rows} | {str(c.get("device")) for c in data["ckpt"] + data["app"]}
                     | ({str(a["rows"][0].get("device"))} if a and a["rows"] else set())
                     | {str(x.get("device")).split(",")[0] for x in (ext.get("incremental"), ext.get("restore_whole")) if x})
    sim = devices == ["simcuda"]
    miss = missing_stages(data)
    L = ["# What a GPU checkpointing layer costs: the overhead report", ""]
    if sim:
        L += ["**A dry run on simcuda, the simulated driver: no figure below is a GPU's.**", ""]
    L += [f"Generated by `{command}` from the results it names (the command's docstring says how each was "
          f"made); device: {', '.join(devices) or NOT}. Each section names its source; the table below gives "
          "the code each ran. A figure the results lack reads \"not measured\", with why.", ""]

    q3 = any(not c.get("skipped") for c in data["ckpt"]) or bool(ext.get("incremental")) or bool(ext.get("restore_whole"))
    q4 = any(not a_.get("skipped") for a_ in data["app"])
    if rows and not sim:
        q2 = "**Answered** below on " + ", ".join(devices) + "."
    elif a and a["rows"]:
        inside = sum(1 for r in a["rows"] if r.get("inside_point"))
        works = list(dict.fromkeys(r["workload"] for r in a["rows"]))
        q2 = (f"**In part.** On {a['rows'][0].get('device')}, what a layer of a known cost a call does to "
              f"{len(works)} workloads ({', '.join(works)}), beside the audit's prediction: {inside} of "
              f"{len(a['rows'])} (workload, cost) pairs inside its bounds within a point (below). **Not measured**: "
              f"the shim's own steady-state cost and the tracer's at its default budget at the current code (the "
              f"suite's steady:* stages): {STEADY_WHY}.")
    else:
        q2 = "**Not yet**: no steady-state (steady:*) stage has run on a GPU."
    app_why = (f"`{ext['dir']}` has no result for " + ", ".join(miss.get("app", [])) + " (the suite's device calls stop at "
               "their time budget and the next resumes where the last stopped; none has run them yet)")
    L += ["## The four questions", "",
          "1. *What does the layer cost on a job that spans several GPUs?* **Not answered**: every run below is on "
          "one GPU; no machine of several GPUs has been lent for these runs, so nothing here measures a job across "
          "GPUs.",
          f"2. *What does it cost on a current GPU?* {q2}",
          "3. *What does taking a checkpoint cost, as against running under the layer?* "
          + ("**Answered for the checkpoint** below: freeze, time back, bytes and write rate, against NVIDIA's "
             "driver API on the same job. The comparison with running under the layer "
             + ("is below." if rows and not sim else "waits on the shim's steady-state cost, not measured (question 2).")
             if q3 else "**Not yet**: no checkpoint-cost run is committed."),
          "4. *Checkpointing inside the application against below it?* "
          + ("**Answered** below." if q4 else f"**Not yet**: not measured: {app_why}."),
          ""]
    L += sources(data, ext)
    L += audit_section(a, plot_rel, made)
    if not rows:
        L += steady_missing_section(data, ext.get("rates"), ext.get("rates_path"))

    if rows:
        L += ["## Running under the layer", "",
              "Each workload ran as three warm processes at once, each idle while another ran: phases of "
              "one alternated with phases of another, each measured against the mean of its neighbours. "
              "*control* is a second native process against the first (what two processes of one job "
              "differ by with no layer at all); *shim* is the process under gputrace's shim; *tracer* "
              "is `gputrace attach -d 5` at its default budget, counted in whole steps, with its own "
              "accounted cost. Medians with their 95% interval.", "",
              "| workload | calls a step | GPU ms a step | calls per GPU-ms | native steps/s | control | shim (audit's bounds) | tracer (accounted) | rates within ±10% after 5 s |",
              "|---|---|---|---|---|---|---|---|---|"]
        if miss.get("steady"):
            L[-2:-2] = [f"Not measured: {', '.join(miss['steady'])}: `{ext['dir']}` has no result for them.", ""]
        lost = [f"{r['job']}: {r['gpu_error']}" for r in rows if r["gpu_ms_per_step"] is None]
        for r in rows:
            sim_note = " (simulated)" if r["gpu_simulated"] else ""
            L.append(f"| {r['job']} | {r['calls_per_step']:.0f} | {num(r['gpu_ms_per_step'])}{sim_note} | "
                     f"{num(r['calls_per_gpu_ms'])} | {num(r['native_steps_per_s'], '{:.0f}')} | "
                     f"{ci_pct(r['control'], 2)} | {ci_pct(r['shim'], 2)} ({pct(r['shim_lower'], 2)}..{pct(r['shim_upper'], 2)}) | "
                     f"{ci_pct(r['tracer'], 2)} ({ci_pct(r['tracer_accounted'], 2)}) | "
                     f"{NOT if r['rates_pairs'] is None else str(r['rates_within_10pct']) + ' of ' + str(r['rates_pairs'])} |")
        if lost:
            L += ["", "GPU time not measured: " + "; ".join(lost) + "."]
        L += ["", "### The emulated layer against the audit's prediction", "",
              "The shim's emulated layer adds a set busy CPU time to every call of the classes chosen; the "
              "audit predicts, from the rates of the workload's first 5-s attach and the wait it timed, a "
              f"slowdown between max(0, A − wait) and A × {INDIRECT_MAX} (A: the layer's added CPU seconds a "
              "second). The error is how far the measured median lies outside the bounds (0 inside).", ""]
        if made:
            L += [f"![slowdown against calls per GPU-ms]({plot_rel}/slowdown-vs-calls-per-gpu-ms.png)", "",
                  f"![prediction against measurement]({plot_rel}/prediction-vs-measurement.png)", ""]
        L += ["At 0 µs the layer still reads the clock and counts each call it slows: that row is its floor, "
              "and the last column is each row less it (the layer's own cost over the floor), against the same bounds.", "",
              "| workload | layer | measured (95% interval) | audit's bounds | error | over the floor |",
              "|---|---|---|---|---|---|"]
        notes = data["notes"]
        for r in rows:
            for e in r["emulation"]:
                ci = e["measured_ci"] or [None, None]
                inter = "" if ci[0] is None else f" ({100 * ci[0]:.1f}..{100 * ci[1]:.1f})"
                err = NOT if e["miss"] is None else ("inside" if e["miss"] == 0 else f"{100 * e['miss']:.1f} points outside")
                if e["over_floor"] is None:
                    floor = NOT if e["cost_ns"] else "(the floor)"
                else:
                    m = e["over_floor_miss"]
                    floor = f"{pct(e['over_floor'])}: " + ("inside" if m == 0 else f"{100 * m:.1f} points outside")
                L.append(f"| {r['job']} | {e['cost_ns'] / 1000:g} µs, {SUB_ALL[e['selection']]} | "
                         f"{pct(e['measured'])}{inter} | {pct(e['lower'])}..{pct(e['upper'])} | {err} | {floor} |")
        L += ["", "Per workload, the largest error of its prediction, and why where it is off by more than a point:", ""]
        for r in rows:
            misses = [e["miss"] for e in r["emulation"] if e["miss"] is not None and e["cost_ns"] > 0]
            shim_miss = None if shim_like_control(r) else r["shim_miss"]
            worst = max(misses + ([shim_miss] if shim_miss is not None else []), default=None)
            why = ""
            if worst is not None and worst > 0.01:
                why = f" Why: {notes[r['job']]}" if r["job"] in notes else " Why: not explained yet."
            shim = (" The shim itself cannot be told from a second native process here (their intervals meet)."
                    if shim_like_control(r) else "")
            t, acc = r["tracer"] or {}, r["tracer_accounted"] or {}
            if t.get("median") is not None and acc.get("median") is not None:
                shim += (f" The tracer at its default budget: {pct(t['median'], 2)} against the {pct(acc['median'], 2)} "
                         f"it accounted ({100 * (t['median'] - acc['median']):+.2f} points).")
            L.append(f"- **{r['job']}**: {NOT if worst is None else ('inside every bound' if worst == 0 else f'{100 * worst:.1f} points outside at most')}.{why}{shim}")
        L.append("")
        L += tracks(rows)

    L += ["## Taking a checkpoint, against NVIDIA's driver API on the same job", ""]
    if miss.get("ckpt"):
        L += [f"Not measured: {', '.join(miss['ckpt'])}: `{ext['dir']}` has no result for them (the suite's device calls stop "
              "at their time budget and the next resumes where the last stopped; none has run them yet).", ""]
    if data["ckpt"]:
        L += ["### The suite's checkpoint stages: whole device checkpoints", "",
              "Freeze: how long the job was stopped; back: from the restore's start to the job running; "
              "write: the image's bytes over the time to write them to that storage.", ""]
        if any(p.name == "freeze-vs-size.png" for p in made):
            L += [f"![freeze against size]({plot_rel}/freeze-vs-size.png)", ""]
        L += ["| size | storage | path | freeze s | back s | bytes | write GB/s | data after restore |",
              "|---|---|---|---|---|---|---|---|"]
        for c in sorted(data["ckpt"], key=lambda c: (c.get("size_gib", 0), str(c.get("storage")))):
            size = f"{c.get('size', c.get('size_gib'))} {c.get('size_unit', 'GiB')}"
            if c.get("skipped"):
                L.append(f"| {size} | {c.get('storage')} | every path | not measured: {c['skipped']} | | | | |")
                continue
            plain = ((c.get("limits") or {}).get("storage_write") or {}).get("write_gb_s")
            for name, p in (c.get("paths") or {}).items():
                if not isinstance(p, dict):
                    continue
                if p.get("skipped") or p.get("error"):
                    L.append(f"| {size} | {c.get('storage')} | {name} | not measured: "
                             f"{p.get('skipped') or p.get('error')} | | | | |")
                    continue
                write = p.get("write_gb_s")
                reason = str(p.get("write_gb_s_reason") or "").split(":")[0]
                write_s = (f"{NOT} ({reason})" if reason else NOT) if write is None else f"{write:.2f}"
                data_ok = {True: "equal", False: "DIFFERS"}.get(p.get("data_ok"), NOT)
                L.append(f"| {size} | {c.get('storage')} | {name} | {num(p.get('freeze_s'))} | "
                         f"{num(p.get('back_s'))} | {num(p.get('bytes'), '{:,}')} | {write_s} | {data_ok} |")
            if plain is not None:
                L.append(f"| {size} | {c.get('storage')} | (a plain fsynced write there) | | | | {plain:.2f} | |")
        L.append("")
        L += ckpt_vs_driver(data["ckpt"])
    L += incremental_section(ext.get("incremental"), ext.get("incremental_path"), plot_rel, made)
    L += restore_whole_section(ext.get("restore_whole"), ext.get("restore_whole_path"))
    if not data["app"]:
        L += ["## Inside the application against below it", "", f"Not measured: {app_why}.", ""]
    if data["app"]:
        L += ["## Inside the application against below it", "",
              "The failure model (bench/failure_model.py): " + fm_assumptions(mtbf_h), ""]
        if miss.get("app"):
            L += [f"Not measured: {app_why}.", ""]
        if any(p.name == "app-vs-system.png" for p in made):
            L += [f"![application-level against system-level]({plot_rel}/app-vs-system.png)", ""]
        L += ["| size | method | job held s | to resume s | size on storage | interval at 1% | work lost a failure | Young/Daly interval |",
              "|---|---|---|---|---|---|---|---|"]
        for a in data["app"]:
            if a.get("skipped"):
                L.append(f"| {a.get('size')} | every method | not measured: {a['skipped']} | | | | | |")
            for f in failure_rows(a, mtbf_h):
                p = f["plan"]
                if f["held_s"] is None and f["resume_s"] is None:
                    L.append(f"| {a.get('size')} | {f['method']} | not measured: {f['error'] or 'no figure'} | | | | | |")
                    continue
                L.append(f"| {a.get('size')} | {f['method']} | {num(f['held_s'])} | {num(f['resume_s'])} | "
                         f"{num(f['bytes'], '{:,}')} | {num(p.interval_s, '{:.0f} s')} | "
                         f"{num(p.lost_per_failure_s, '{:.0f} s')} | {num(p.young_interval_s, '{:.0f} s')} |")
        L.append("")
    L += ["## Public figures", "",
          "None is placed beside these: the repository's documents cite no public figure for comparable work "
          "(and none could be fetched where this report is made).", ""]
    if data.get("failed"):
        L += ["## Stages that failed (not measured)", ""]
        L += [f"- {x.get('stage')}: {x['failed']}" for x in data["failed"]]
        L.append("")
    L += ["## Reproduce", "",
          "Each input's README (or the command's docstring) gives the device call that made it; the suite's, "
          "repeated until it exits 0 (see `bench/overhead_suite.py --help`):", "",
          "    source bench/gpu-env.sh && python3 bench/overhead_suite.py --out bench/results/overhead-h200 --budget-s 500 \\",
          "        --pack $OUT/overhead-h200.tar.xz", "",
          "then here, without a GPU:", "", f"    {command}", ""]
    return "\n".join(L)


def rel(p: Path) -> str:
    r = p.resolve()
    return str(r.relative_to(ROOT)) if r.is_relative_to(ROOT) else str(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the suite's results (bench/overhead_suite.py --out)")
    ap.add_argument("--audit", help="bench/audit_validate.py's results (its --out)")
    ap.add_argument("--incremental", help="bench/incremental_costs_gpu.py's incremental-costs.json, or its folder")
    ap.add_argument("--restore-whole", help="bench/restore_whole_gpu.py's JSON")
    ap.add_argument("--rates", help="bench/rates_gpu.py's rates.json.xz, or its folder")
    ap.add_argument("--md", default=str(ROOT / "docs/overhead-report.md"), help="the report (default docs/overhead-report.md)")
    ap.add_argument("--plots", default=None, help="the plots' folder (default: beside the report, named after it)")
    ap.add_argument("--mtbf-h", type=float, default=24.0, help="the failure model's mean time between failures, hours")
    a = ap.parse_args(argv)
    d = Path(a.dir)
    if not d.is_dir():
        raise SystemExit(f"overhead_report: no such directory: {d} (bench/overhead_suite.py --out makes it)")
    data = load(d)
    if not (data["steady"] or data["ckpt"] or data["app"] or data["failed"]):
        raise SystemExit(f"overhead_report: no results in {d}: run bench/overhead_suite.py --out {d} first")
    opt = {k: getattr(a, k) and Path(getattr(a, k)) for k in ("audit", "incremental", "restore_whole", "rates")}
    ext = {"dir": rel(d), "audit": load_audit(opt["audit"]),
           "incremental": load_json(opt["incremental"], "incremental-costs.json"),
           "restore_whole": load_json(opt["restore_whole"]), "rates": load_json(opt["rates"], "rates.json.xz")}
    for k in ("incremental", "restore_whole", "rates"):
        ext[f"{k}_path"] = opt[k] and rel(opt[k])
    if ext["audit"]:
        ext["audit"]["dir"] = rel(opt["audit"])
    command = " ".join([".venv/bin/python bench/overhead_report.py", rel(d)]
                       + [f"--{k.replace('_', '-')} {rel(v)}" for k, v in opt.items() if v]
                       + ([f"--mtbf-h {a.mtbf_h:g}"] if a.mtbf_h != 24.0 else []))
    md = Path(a.md)
    plot_dir = Path(a.plots) if a.plots else md.with_suffix("")
    rows = [workload_figures(doc) for doc in data["steady"]]
    made = plots(rows, data["ckpt"], data["app"], plot_dir) + ext_plots(ext, plot_dir)
    try:
        plot_rel = str(plot_dir.resolve().relative_to(md.parent.resolve()))
    except ValueError:
        plot_rel = str(plot_dir.resolve())
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render(data, ext, plot_rel, made, a.mtbf_h, command))
    print(f"wrote {md} and {len(made)} plot(s) in {plot_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
