"""`gputrace report FILES...`: recordings of several nodes merged into one report by workload."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import orjson

from ..base.errors import GputraceError, UsageError
from ..base.units import fmt_pct, fmt_rate
from ..registry import command, dump_json, number, parse_share

REPORT_EPILOG = """examples:
  gputrace record -o node-$(hostname).jsonl -d 600        on each node (or from the DaemonSet)
  gputrace report node-*.jsonl -o fleet/                 fleet/report.md, report.json and the plots
  gputrace report node-*.jsonl --preset proxy --threshold 2%
  gputrace report node-*.jsonl --cost-ns 5000 --classes submission,synchronization --json

Each process counts once, as last recorded; a workload is its pod's workload (Kubernetes) or its
command. For a layer of the preset's cost a call (or --cost-ns, on --classes), each workload's worst
process gives the bounds on its slowdown: `above` when even the lower bound exceeds the threshold,
`maybe above` when only the upper bound does. Plots need matplotlib (pip install 'gputrace[report]').
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="recordings written by `gputrace record`")
    p.add_argument("-o", "--output", metavar="DIR", help="directory for report.md, report.json and the plots")
    p.add_argument("--preset", default="shim", help="the layer to audit for (default shim; see `attach --help`)")
    p.add_argument("--cost-ns", type=number(lo=0), help="the layer's cost a call, instead of the preset's")
    p.add_argument("--classes", help="the classes it intercepts, comma-separated (submission, synchronization, state, query)")
    p.add_argument("--threshold", default="1%", help="the slowdown that matters (default 1%%)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _preset(args: argparse.Namespace):
    from ..tracer.audit import PRESETS, make_preset
    from ..tracer.classify import FunctionClass

    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}", f"choose one of {', '.join(PRESETS)}")
    classes = None
    if args.classes:
        try:
            classes = frozenset(FunctionClass(c.strip()) for c in args.classes.split(",") if c.strip())
        except ValueError as exc:
            raise UsageError(f"--classes: {exc}", "use class names: " + ", ".join(c.value for c in FunctionClass)) from None
    return make_preset(args.preset, args.cost_ns, classes)


@command("report", "merge recordings of several nodes into one report by workload", REPORT_EPILOG)(configure)
def report(args: argparse.Namespace) -> int:
    from ..hostview.fleet import hosts, load, summarize

    preset = _preset(args)
    threshold = parse_share(args.threshold, "threshold")
    jobs = load(args.files)
    if not jobs:
        raise UsageError("the recordings hold no measured process", "record longer: gputrace record -o FILE -d 60")
    rows = summarize(jobs, preset, threshold)
    doc = {"schema": 1, "kind": "gputrace.fleet", "files": args.files, "nodes": hosts(jobs),
           "preset": {"name": preset.name, "cost_ns": preset.cost_ns, "classes": sorted(c.value for c in preset.classes),
                      "cost_source": preset.cost_source},
           "threshold": threshold, "processes": len(jobs),
           "workloads": [dataclasses.asdict(w) for w in rows]}
    text = render(doc)
    if args.output:
        out = Path(args.output)
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
            plots = _plots(jobs, rows, preset, threshold, out)
            (out / "report.md").write_text(text + "".join(f"\n![{p.stem}]({p.name})\n" for p in plots))
        except OSError as exc:
            raise GputraceError(f"cannot write {out}: {exc.strerror}", "choose a writable directory for -o") from None
        print(f"gputrace: report written to {out}/report.md" + (f" with {len(plots)} plot(s)" if plots else
              " (no plots: matplotlib is not installed)"), file=sys.stderr)
    if args.json:
        dump_json(doc)
    elif not args.output:
        sys.stdout.write(text)
    return 0


def render(doc: dict) -> str:
    p = doc["preset"]
    lines = [f"# Fleet report: {doc['processes']} process(es) on {len(doc['nodes'])} node(s)", "",
             f"Layer: {p['name']}, {p['cost_ns']:g} ns a call on {', '.join(p['classes'])} ({p['cost_source']}).",
             f"Threshold: {fmt_pct(doc['threshold'], 1)} slowdown.", "",
             "| workload | kind | nodes | processes | calls/s (median) | intercepted/s | slowdown (worst process) | "
             "verdict |", "|---|---|---:|---:|---:|---:|---|---|"]
    for w in doc["workloads"]:
        lo = "not known" if w["slowdown_lower_max"] is None else fmt_pct(w["slowdown_lower_max"])
        lines.append(f"| {w['workload']} | {w['kind']} | {len(w['nodes'])} | {w['processes']} | "
                     f"{fmt_rate(w['calls_hz_median'])} | {fmt_rate(w['intercepted_hz_median'])} | "
                     f"{lo} .. {fmt_pct(w['slowdown_upper_max'])} | {w['verdict']} |")
    above = [w["workload"] for w in doc["workloads"] if w["verdict"] == "above"]
    maybe = [w["workload"] for w in doc["workloads"] if w["verdict"] == "maybe above"]
    lines += ["", f"Above the threshold: {', '.join(above) or 'none'}.",
              f"Maybe above (only if the layer's cost does not hide in the GPU wait): {', '.join(maybe) or 'none'}.", ""]
    return "\n".join(lines)


def _plots(jobs, rows, preset, threshold: float, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    names = [w.workload for w in rows][::-1]
    for i, w in enumerate(rows[::-1]):
        lo = w.slowdown_lower_max if w.slowdown_lower_max is not None else 0.0
        ax.plot([100 * lo, 100 * w.slowdown_upper_max], [i, i], lw=6, solid_capstyle="butt",
                color={"above": "tab:red", "maybe above": "tab:orange", "below": "tab:green"}[w.verdict])
    ax.axvline(100 * threshold, color="k", ls="--", lw=1)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel(f"predicted slowdown, % ({preset.name}: {preset.cost_ns:g} ns a call; lower .. upper bound)")
    ax.set_title("Predicted slowdown by workload (worst process)")
    fig.tight_layout()
    made.append(out / "slowdown.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for host in sorted({j.host for j in jobs}):
        pts = [(j.row.audit(preset).intercepted_hz, j.row.audit(preset).slowdown_upper)
               for j in jobs if j.host == host and j.row.snapshot.not_measured is None]
        if pts:
            ax.scatter([max(x, 1e-1) for x, _ in pts], [100 * y for _, y in pts], label=host, s=18)
    ax.axhline(100 * threshold, color="k", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("intercepted driver calls/s (per process)")
    ax.set_ylabel("predicted slowdown, upper bound, %")
    ax.legend(fontsize=8)
    ax.set_title("Each process: calls the layer intercepts against its upper bound")
    fig.tight_layout()
    made.append(out / "calls.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    return made
