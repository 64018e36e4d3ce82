"""Cells and sort keys shared by the dashboard's table and `top --once`'s plain text."""

from __future__ import annotations

import math
import time

from gputrace.base.units import fmt_bytes, fmt_ns, fmt_pct, fmt_rate, fmt_rate_or

from gputrace.hostview.model import Checkpoint, HostSnapshot, Job, ProcessRow

SPARK = "▁▂▃▄▅▆▇█"


def fmt_ago(t: float, now: float | None = None) -> str:
    s = max(0.0, (now or time.time()) - t)
    if s < 60:
        return f"{s:.0f}s ago"
    if s < 3600:
        return f"{s / 60:.0f}m ago"
    if s < 86400:
        return f"{s / 3600:.1f}h ago"
    return f"{s / 86400:.1f}d ago"


def fmt_checkpoint(c: Checkpoint | None, now: float | None = None) -> str:
    if c is None:
        return "-"
    return f"{fmt_ago(c.taken_at, now)}, {fmt_bytes(c.size_bytes)}, froze {fmt_ns(c.freeze_s * 1e9 if c.freeze_s is not None else None)}"


TREND_WIDTH = 10  # refreshes the TREND column shows


def sparkline(values: tuple[float, ...], width: int = TREND_WIDTH) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi <= 0:
        return SPARK[0] * len(vals)
    if hi - lo < 0.02 * hi:  # flat within 2%: a mid line, not noise blown up to full height
        return SPARK[3] * len(vals)
    # Scaled between the window's extremes: the trend is what this column is for.
    return "".join(SPARK[int((v - lo) / (hi - lo) * (len(SPARK) - 1) + 0.5)] for v in vals)


def fmt_share(x: float | None) -> str:
    """A percentage with two significant digits below 1%: a 15 ns layer on a quiet job costs
    thousandths of a percent, and "0.00%" would hide the difference between jobs."""
    if x is None:
        return "-"
    v = 100 * x
    if v == 0:
        return "0%"
    if v < 0.001:
        return "<0.001%"  # no layer's cost a user acts on; 0.0000019% is only harder to read
    if v >= 10:
        return f"{v:.1f}%"
    if v >= 1:
        return f"{v:.2f}%"
    return f"{v:.{max(2, 1 - math.floor(math.log10(v)))}f}%"  # two significant digits, never an exponent


def fmt_thread_share(x: float | None) -> str:
    """Seconds a second in driver calls, summed over threads: above 100% marked Σ (the help says why)."""
    return fmt_pct(x, 1) + ("Σ" if x is not None and x > 1.0 else "")


# Thresholds of the predicted upper bound that colour the OVERHEAD cell: under 1% (green), under 5%
# (yellow), above (red); unknown, uncoloured.
OVERHEAD_LEVELS = ((0.01, "low"), (0.05, "mid"))


def overhead_level(r: ProcessRow, preset: str) -> str | None:
    upper = r.audit(preset).slowdown_upper
    if upper is None:
        return None
    return next((name for limit, name in OVERHEAD_LEVELS if upper < limit), "high")


def overhead_bounds(lower: float | None, upper: float | None) -> str:
    """lower–upper; where only the upper bound is known (the wait not measured yet), at most that."""
    if upper is None:
        return "-"
    up = fmt_share(upper)
    if lower is None:
        return up if up.startswith("<") else f"≤{up}"
    return f"{fmt_share(lower)}–{up}"


def overhead_cell(r: ProcessRow, preset: str, now: float | None = None) -> str:
    a = r.audit(preset)
    return overhead_bounds(a.slowdown_lower, a.slowdown_upper)


# Column key -> (title, cell(row, preset, now), sort key(row, preset)); the table and text share these.
COLUMNS = {
    "pid": ("PID", lambda r, p, now: str(r.pid), lambda r, p: r.pid),
    "comm": ("COMMAND", lambda r, p, now: r.comm, lambda r, p: r.comm),
    "calls": ("CALLS/S", lambda r, p, now: fmt_rate_or(r.snapshot.calls_hz, r.snapshot.calls_not_known),
              lambda r, p: r.snapshot.shown_calls_hz),
    # As wide from the first frame as after ten: a column that widens as history comes shifts the others.
    "trend": ("TREND", lambda r, p, now: sparkline(r.calls_history).ljust(TREND_WIDTH), None),
    "cpu": ("DRIVER CPU", lambda r, p, now: fmt_thread_share(r.snapshot.driver_cpu_s_per_s), lambda r, p: r.snapshot.driver_cpu_s_per_s),
    "wait": ("WAIT", lambda r, p, now: fmt_thread_share(r.snapshot.wait_s_per_s), lambda r, p: r.snapshot.wait_s_per_s),
    "overhead": ("OVERHEAD", overhead_cell, lambda r, p: (r.audit(p).slowdown_upper, r.audit(p).slowdown_lower)),
    "shim": ("SHIM", lambda r, p, now: "yes" if r.shimmed else "no", lambda r, p: r.shimmed),
    "ckpt": ("LAST CHECKPOINT", lambda r, p, now: fmt_checkpoint(r.last_checkpoint, now),
             lambda r, p: r.last_checkpoint.taken_at if r.last_checkpoint else 0.0),
}
SORTABLE = tuple(k for k, (_, _, key) in COLUMNS.items() if key is not None)
DESCENDING = frozenset({"calls", "cpu", "wait", "overhead", "ckpt", "shim"})  # biggest first is what one looks for


def _known_first(v):
    """A sort key in which "not measured" (None) sorts below every figure, never beside it."""
    if isinstance(v, tuple):
        return tuple(_known_first(x) for x in v)
    return (v is not None, v if v is not None else 0)


def sort_rows(rows: tuple[ProcessRow, ...], key: str, preset: str, reverse: bool = False) -> list[ProcessRow]:
    k = COLUMNS[key][2]
    desc = (key in DESCENDING) != reverse
    return sorted(rows, key=lambda r: (_known_first(k(r, preset)), -r.pid if desc else r.pid), reverse=desc)


def matches(r: ProcessRow, text: str) -> bool:
    t = text.strip().lower()
    return not t or t in r.comm.lower() or t in str(r.pid) or (t == "shim" and r.shimmed)


def job_line(j: Job) -> str:
    """A job of several ranks in a line: `top --once`'s text and the dashboard's header alike."""
    ranks = ", ".join(f"rank {rank} pid {pid}" if rank is not None else f"pid {pid}" for rank, pid in j.ranks)
    of = f" of {j.world}" if j.world is not None and j.world != len(j.ranks) else ""
    bound = overhead_bounds(j.slowdown_lower, j.slowdown_upper)
    slowest = f", slowest rank pid {j.slowest}" if j.slowest is not None and bound != "-" else ""
    return (f"job {j.key}: {len(j.ranks)} ranks{of} ({ranks}), {fmt_rate(j.calls_hz)} calls/s, "
            f"overhead {bound} (its slowest rank's{slowest})")


def render_host(h: HostSnapshot, preset: str) -> str:
    now = h.t
    gpus = "; ".join(f"{g.index}: {g.name} {'-' if g.util_pct is None else f'{g.util_pct:.0f}%'} "
                     f"{fmt_bytes(g.mem_used_bytes)}/{fmt_bytes(g.mem_total_bytes)}"
                     + (f" {len(g.processes)} process(es)" if g.processes else "") for g in h.gpus) or f"none ({h.gpu_note})"
    lines = [f"{h.host}  GPUs: {gpus}",
             f"tracer: at most {fmt_pct(h.tracer_overhead)} of a traced process's time (budget {fmt_pct(h.budget, 1)} each); "
             f"overhead preset {preset}"]
    keys = [k for k in COLUMNS if k != "trend"]
    rows = [[COLUMNS[k][1](r, preset, now) for k in keys] for r in sort_rows(h.processes, "overhead", preset)]
    heads = [COLUMNS[k][0] for k in keys]
    widths = [max(len(x) for x in col) for col in zip(heads, *rows)]
    for row in [heads, *rows]:
        lines.append("  ".join(c.ljust(w) if i in (1, len(keys) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    if not h.processes:
        lines.append("(no CUDA process measured)")
    lines += [job_line(j) for j in h.jobs(preset)]
    lines += [f"not measured yet: pid {p}" for p in h.pending] + list(h.notes)
    return "\n".join(lines) + "\n"
