"""One process: its driver functions, the latency histogram of the selected one, the audit."""

from __future__ import annotations

import collections

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Sparkline, Static

from gputrace.base.units import fmt_bytes, fmt_ns, fmt_pct, fmt_rate, fmt_rate_or
from gputrace.hostview.model import Gpu, HostSnapshot, ProcessRow
from gputrace.tracer.model import FunctionStats

from ..text import fmt_checkpoint, fmt_share

HISTORY = 120  # refreshes a detail screen plots


def histogram(f: FunctionStats, width: int = 30) -> Text:
    """The log2 buckets with any count, as bars: slot k holds calls of [2^(k-1), 2^k) ns."""
    t = Text(f"{f.name}\n", style="bold")
    t.append(f"time per call, {sum(f.hist)} calls timed\n", style="dim")
    used = [k for k, n in enumerate(f.hist) if n]
    if not used:
        t.append("not timed in this interval", style="dim")
        return t
    top = max(f.hist)
    for k in range(used[0], used[-1] + 1):
        n = f.hist[k]
        lo = fmt_ns(2 ** (k - 1) if k else 0)
        hi = fmt_ns(2**k)
        t.append(f"{lo:>9}–{hi:<9}")
        t.append("█" * max(1 if n else 0, round(n / top * width)), style="cyan")
        t.append(f" {n}\n")
    return t


def gpus_of(pid: int, gpus: tuple[Gpu, ...]) -> str:
    """The GPUs NVML lists the process on, with the memory it holds on each."""
    on = [f"GPU{g.index} ({fmt_bytes(used)})" for g in gpus for p, used in g.processes if p == pid]
    return ", ".join(on) if on else "none listed by NVML" if gpus else "not known (no NVML)"


def audit_text(row: ProcessRow, preset: str, now: float | None = None, gpus: tuple[Gpu, ...] = ()) -> Text:
    s, a = row.snapshot, row.audit(preset)
    t = Text()
    t.append(f"pid {row.pid} ({row.comm})", style="bold")
    t.append(f"  shimmed: {'yes' if row.shimmed else 'no'}  last checkpoint: {fmt_checkpoint(row.last_checkpoint, now)}"
             f"  on {gpus_of(row.pid, gpus)}\n")
    t.append(f"libcuda {row.library or '?'}\n", style="dim")
    t.append(f"driver calls {fmt_rate_or(s.calls_hz, s.calls_not_known)}/s; driver CPU {fmt_pct(s.driver_cpu_s_per_s, 1)}; "
             f"wait {fmt_pct(s.wait_s_per_s, 1)}; probes attached {fmt_pct(min(1.0, s.window_s / s.interval_s) if s.interval_s else 0, 0)} "
             f"of {s.interval_s:.1f} s; tracer {fmt_pct(s.tracer_overhead)} of its time\n")
    t.append(f"preset {a.preset}: intercepts {', '.join(a.classes)} at {fmt_ns(a.cost_ns)} a call ({a.cost_source})\n")
    if a.not_known:
        t.append(f"intercepted rate not known ({a.not_known}); over that interval: ")
    else:
        t.append(f"{fmt_rate(a.intercepted_hz)} calls/s intercepted -> {fmt_ns(a.added_cpu_s_per_s * 1e9)} CPU per second; ")
    if a.lower_basis == "threads":
        low = "not known" if a.slowdown_lower is None else fmt_share(a.slowdown_lower)
        t.append(f"predicted slowdown {low} (hidden in the calling threads' slack) – {fmt_share(a.slowdown_upper)} (exposed)",
                 style="bold")
        for th in sorted(a.threads or (), key=lambda th: -th.added_s_per_s)[:3]:
            if th.added_s_per_s > 0:
                slack = "slack not known" if th.headroom_s_per_s is None else f"slack {fmt_share(th.headroom_s_per_s)}"
                t.append(f"\n  thread {th.tid} ({th.comm}): {100 * th.intercepted_share:.0f}% of the calls, "
                         f"+{fmt_share(th.added_s_per_s)} of its time; {slack}")
    else:
        t.append(f"predicted slowdown {fmt_share(a.slowdown_lower)} (hidden in the wait) – {fmt_share(a.slowdown_upper)} (exposed)",
                 style="bold")
    return t


class DetailScreen(Screen):
    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "back"), Binding("p", "preset", "preset"),
                Binding("c", "act('checkpoint')", "checkpoint"), Binding("r", "act('restore')", "restore"),
                Binding("s", "act('suspend')", "suspend"), Binding("u", "act('resume')", "resume"),
                Binding("w", "act('checkpoint_full')", "whole job")]
    DEFAULT_CSS = """
    DetailScreen #audit { height: auto; padding: 0 1; background: $boost; }
    DetailScreen #history { height: auto; padding: 0 1; }
    DetailScreen #history Sparkline { height: 2; margin-bottom: 1; }
    DetailScreen Horizontal { height: 1fr; }
    DetailScreen #functions { width: 2fr; }
    DetailScreen #hist-box { width: 1fr; min-width: 30; }
    """

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid
        self.row: ProcessRow | None = None
        self.names: list[str] = []
        # The job's history while this screen is open, on top of the calls/s its row brought with
        # it: rows, so that the overhead follows the preset shown.
        self.seen: collections.deque[ProcessRow] = collections.deque(maxlen=HISTORY)
        self.before: tuple[float, ...] = ()  # calls/s of the refreshes before the screen opened

    def compose(self) -> ComposeResult:
        yield Static(id="audit")
        with Vertical(id="history"):
            yield Static(id="calls-label")
            yield Sparkline([], id="calls-plot")
            yield Static(id="overhead-label")
            yield Sparkline([], id="overhead-plot")
        with Horizontal():
            yield DataTable(id="functions", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="hist-box"):
                yield Static(id="hist")
        yield Footer()

    def on_mount(self) -> None:
        t = self.query_one("#functions", DataTable)
        for key, title in (("name", "FUNCTION"), ("cls", "CLASS"), ("rate", "CALLS/S"), ("mean", "MEAN"), ("p99", "P99 <")):
            t.add_column(title, key=key)
        self.show_frame(self.app.frame)
        t.focus()

    def show_frame(self, frame: HostSnapshot | None) -> None:
        row = next((r for r in frame.processes if r.pid == self.pid), None) if frame else None
        audit = self.query_one("#audit", Static)
        if row is None:
            if self.row is not None:
                audit.update(Text(f"pid {self.pid} is gone (exited, or no longer measured); last figures below",
                                  style="yellow"))
            return
        self.row = self.app.with_overrides(row)
        if not self.seen:
            self.before = row.calls_history[:-1]  # its last point is this row's own
        if not self.seen or self.seen[-1] is not row:
            self.seen.append(row)
        self._show_history()
        audit.update(audit_text(self.row, self.app.preset, frame.t, frame.gpus))
        t = self.query_one("#functions", DataTable)
        keep = self.selected_name()
        t.clear()
        self.names = [f.name for f in row.snapshot.functions]
        for f in row.snapshot.functions:
            t.add_row(f.name, f.cls.value, Text(fmt_rate_or(f.rate_hz, f.not_known), justify="right"),
                      Text(fmt_ns(f.mean_ns), justify="right"), Text(fmt_ns(f.p99_ns), justify="right"), key=f.name)
        if keep in self.names:
            t.move_cursor(row=self.names.index(keep))
        self._show_hist()

    def _show_history(self) -> None:
        calls = [c for c in (*self.before, *(r.snapshot.shown_calls_hz for r in self.seen)) if c is not None][-HISTORY:]
        preset = self.app.preset
        upper = [r.audit(preset).slowdown_upper for r in self.seen]
        upper = [u for u in upper if u is not None]
        self.query_one("#calls-plot", Sparkline).data = calls
        self.query_one("#overhead-plot", Sparkline).data = upper
        self.query_one("#calls-label", Static).update(Text.assemble(
            ("calls/s", "bold"), f"  last {len(calls)} refreshes: {fmt_rate(min(calls))} .. {fmt_rate(max(calls))}"
            if calls else "  not measured yet"))
        self.query_one("#overhead-label", Static).update(Text.assemble(
            ("predicted overhead, upper", "bold"),
            f"  ({preset} preset) since this screen opened: {fmt_share(min(upper))} .. {fmt_share(max(upper))}"
            if upper else f"  ({preset} preset) not measured yet"))

    def selected_name(self) -> str | None:
        t = self.query_one("#functions", DataTable)
        if not self.names or not 0 <= t.cursor_row < len(self.names):
            return None
        return self.names[t.cursor_row]

    def _show_hist(self) -> None:
        name = self.selected_name()
        f = next((f for f in self.row.snapshot.functions if f.name == name), None) if self.row else None
        box = self.query_one("#hist", Static)
        width = max(6, (box.size.width or 60) - 34)  # what the labels and the count leave for the bars
        box.update(histogram(f, width) if f else Text("no function selected", style="dim"))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_hist()

    def action_preset(self) -> None:
        self.app.next_preset()
        self._show_history()

    def action_act(self, action: str) -> None:
        if self.row is not None:
            self.app.request_action(action, self.row)
