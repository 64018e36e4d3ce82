"""The dashboard's widgets: the host header, the action status line, and the process table
(tui/table.py)."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import Static

from gputrace.report import fmt_pct

from .model import HostSnapshot
from .table import ProcessTable, columns_for  # noqa: F401  (the screens import them from here)
from .text import COLUMNS, fmt_bytes


class HostHeader(Static):
    DEFAULT_CSS = "HostHeader { height: auto; padding: 0 1; background: $boost; }"
    _shape: tuple[int, ...] = ()

    def show(self, h: HostSnapshot | None, preset: str, sort: str, reverse: bool, filt: str, state: str) -> None:
        if h is None:
            self.update(Text(f"gputrace top — {state or 'starting: compiling the BPF program and calibrating ...'}"))
            return
        t = Text()
        t.append(h.host, style="bold")
        t.append("  ")
        if h.gpus:
            t.append("  ".join(f"GPU{g.index} {g.name} {g.util_pct if g.util_pct is not None else '-':>3}% "
                               f"{fmt_bytes(g.mem_used_bytes)}/{fmt_bytes(g.mem_total_bytes)}" for g in h.gpus))
        else:
            t.append(f"GPUs: none ({h.gpu_note})", style="dim")
        t.append("\n")
        t.append(f"tracer {fmt_pct(h.tracer_overhead)} of traced CPU (budget {fmt_pct(h.budget, 1)})  ")
        t.append(f"{len(h.processes)} processes", style="bold")
        if h.pending:
            t.append(f", {len(h.pending)} attaching")
        if h.notes:
            t.append(f", {len(h.notes)} not traceable", style="yellow")
        t.append(f"  preset {preset}  sort {COLUMNS[sort][0].lower()}{' ↑' if reverse else ''}")
        if filt:
            t.append(f"  filter '{filt}'", style="cyan")
        t.append(f"  {time.strftime('%H:%M:%S', time.localtime(h.t))}")
        if state:
            t.append(f"  {state}", style="yellow")
        # A layout pass (about 10 ms with 50 rows) only when the header's height may change: most
        # refreshes change only figures and the clock, not how many lines the text wraps to.
        width = max(1, self.content_region.width)
        shape = (width, *(-(-max(1, len(line)) // width) for line in t.plain.split("\n")))
        self.update(t, layout=shape != self._shape)
        self._shape = shape


class StatusLine(Static):
    DEFAULT_CSS = "StatusLine { height: auto; padding: 0 1; background: $panel; }"
