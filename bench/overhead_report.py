#!/usr/bin/env python3
"""docs/overhead-report.md and its plots, from the overhead suite's committed results (no GPU needed).

    .venv/bin/python bench/overhead_report.py bench/results/overhead-h200
        writes docs/overhead-report.md and docs/overhead-report/*.png
    .venv/bin/python bench/overhead_report.py DIR --md OUT.md --plots OUTDIR [--mtbf-h 24]

Every figure in the report is worked out here from DIR's JSON (bench/overhead_suite.py wrote it):
steady-JOB.json (a workload native, under the shim, under the tracer, under the emulated layer),
ckpt-SIZE-STORAGE.json (bench/ckpt_costs_gpu.py), app-SIZE.json (bench/appckpt_gpu.py), and
DIR/notes.json, the one hand-written input: {"WORKLOAD": "why its prediction is off"}, quoted where
the audit's bounds miss a measurement (a miss without a note says "not explained yet").
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


# --- the report ----------------------------------------------------------------------------------------------


def fm_assumptions(mtbf_h: float) -> str:
    import failure_model as fm

    return fm.assumptions(fm.FailureModel(mtbf_h=mtbf_h))


def render(data: dict, d: Path, plot_rel: str, made: list[Path], mtbf_h: float) -> str:
    rows = [workload_figures(doc) for doc in data["steady"]]
    devices = sorted({str(r["device"]) for r in rows} | {str(c.get("device")) for c in data["ckpt"] + data["app"]})
    commits = sorted({str(x.get("commit")) for x in data["steady"] + data["ckpt"] + data["app"]})
    sim = devices == ["simcuda"]
    L = ["# What a GPU checkpointing layer costs: the overhead report", ""]
    if sim:
        L += ["**A dry run on simcuda, the simulated driver: no figure below is a GPU's.**", ""]
    L += [f"Generated by `bench/overhead_report.py {d}` from the suite's results (`bench/overhead_suite.py`); "
          f"device: {', '.join(devices) or NOT}; code at {', '.join(c[:10] for c in commits) or NOT}.", ""]

    q3 = any(not c.get("skipped") for c in data["ckpt"])
    q4 = any(not a.get("skipped") for a in data["app"])
    L += ["## The four questions", "",
          "1. *What does the layer cost on a job that spans several GPUs?* **Not answered here**: every run "
          "below is on one GPU (the multi-GPU part waits on a machine of several GPUs).",
          f"2. *What does it cost on a current GPU?* {'**Answered** below on ' + ', '.join(devices) if rows and not sim else '**Not yet**: no steady-state (steady:*) stage has run on a GPU.'}",
          f"3. *What does taking a checkpoint cost?* {'**Answered** below (freeze, time back, bytes, write throughput).' if q3 else '**Not yet**: no checkpoint-cost run is committed.'}",
          f"4. *Checkpointing inside the application against below it?* {'**Answered** below.' if q4 else '**Not yet**: no application-level run is committed.'}",
          ""]

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

    if data["ckpt"]:
        L += ["## Taking a checkpoint", "",
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

    if data["app"]:
        L += ["## Inside the application against below it", "",
              "The failure model (bench/failure_model.py): " + fm_assumptions(mtbf_h), ""]
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
    if data.get("failed"):
        L += ["## Stages that failed (not measured)", ""]
        L += [f"- {x.get('stage')}: {x['failed']}" for x in data["failed"]]
        L.append("")
    L += ["## Reproduce", "",
          "On the GPU machine, repeated until it exits 0 (see `bench/overhead_suite.py --help`):", "",
          "    source bench/gpu-env.sh && python3 bench/overhead_suite.py --out bench/results/overhead-h200 --budget-s 500 \\",
          "        --pack $OUT/overhead-h200.tar.xz", "",
          "then here, without a GPU:", "", f"    .venv/bin/python bench/overhead_report.py {d}", ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the suite's results (bench/overhead_suite.py --out)")
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
    md = Path(a.md)
    plot_dir = Path(a.plots) if a.plots else md.with_suffix("")
    rows = [workload_figures(doc) for doc in data["steady"]]
    made = plots(rows, data["ckpt"], data["app"], plot_dir)
    try:
        rel = str(plot_dir.resolve().relative_to(md.parent.resolve()))
    except ValueError:
        rel = str(plot_dir.resolve())
    shown = d.resolve().relative_to(ROOT) if d.resolve().is_relative_to(ROOT) else d
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render(data, shown, rel, made, a.mtbf_h))
    print(f"wrote {md} and {len(made)} plot(s) in {plot_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
