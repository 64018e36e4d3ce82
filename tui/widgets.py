"""The dashboard's widgets: the host header, the process table, the action status line."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable, Static

from gputrace.report import fmt_pct

from .model import HostSnapshot, ProcessRow
from .text import COLUMNS, fmt_bytes

# Columns in the order they are dropped as the terminal narrows (last dropped first).
PRIORITY = ("pid", "comm", "overhead", "calls", "shim", "wait", "cpu", "ckpt", "trend")
WIDTHS = {"pid": 8, "comm": 16, "overhead": 16, "calls": 9, "shim": 5, "wait": 7, "cpu": 11, "ckpt": 30, "trend": 11}
ORDER = tuple(COLUMNS)  # display order


def columns_for(width: int) -> tuple[str, ...]:
    shown, used = [], 0
    for k in PRIORITY:
        need = WIDTHS[k] + 2
        if shown and used + need > width:
            break
        shown.append(k)
        used += need
    return tuple(k for k in ORDER if k in shown)


class HostHeader(Static):
    DEFAULT_CSS = "HostHeader { height: auto; padding: 0 1; background: $boost; }"

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
        self.update(t)


class ProcessTable(DataTable):
    """One row per process, keyed by pid so the cursor stays on its process across refreshes."""

    DEFAULT_CSS = "ProcessTable { height: 1fr; }"

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.shown: tuple[str, ...] = ()
        self.pids: list[int] = []
        # Until the user moves the cursor it stays on the top row (the costliest process, as
        # sorted); once moved, it follows the process it was put on through re-sorting.
        self.user_moved = False
        self._keep: int | None = None
        self._cells: list[list[Text]] = []

    def _moved(self) -> None:
        self.user_moved = True

    def action_cursor_up(self) -> None:
        self._moved()
        super().action_cursor_up()

    def action_cursor_down(self) -> None:
        self._moved()
        super().action_cursor_down()

    def action_page_up(self) -> None:
        self._moved()
        super().action_page_up()

    def action_page_down(self) -> None:
        self._moved()
        super().action_page_down()

    def action_scroll_home(self) -> None:
        self._moved()
        super().action_scroll_home()

    def action_scroll_end(self) -> None:
        self._moved()
        super().action_scroll_end()

    def on_click(self) -> None:
        self._moved()

    def set_columns(self, keys: tuple[str, ...], sort: str, reverse: bool) -> None:
        self._keep = self.selected_pid()  # clearing the columns resets the cursor
        self.clear(columns=True)
        self._cells = []
        self.shown = keys
        for k in keys:
            title = COLUMNS[k][0] + ((" ▲" if reverse else " ▼") if k == sort else "")
            left = k in ("comm", "ckpt", "trend")
            self.add_column(Text(title, justify="left" if left else "right"), key=k)

    def _cell(self, k: str, r: ProcessRow, preset: str, now: float) -> Text:
        c = COLUMNS[k][1](r, preset, now)
        style = "green" if k == "shim" and r.shimmed else ("bold" if k == "overhead" else "")
        return Text(c, style=style, justify="left" if k in ("comm", "ckpt", "trend") else "right")

    def show(self, rows: list[ProcessRow], preset: str, now: float) -> None:
        """Updates only the cells that changed when the rows are the same in the same order (the
        common case between two refreshes); rebuilding the table re-renders every cell, which cost
        a fifth of a core at 50 rows and 1 Hz."""
        selected = self._keep if self._keep is not None else self.selected_pid()
        self._keep = None
        cells = [[self._cell(k, r, preset, now) for k in self.shown] for r in rows]
        pids = [r.pid for r in rows]
        if pids == self.pids and self.row_count == len(pids) and self._cells:
            for r, old, new in zip(rows, self._cells, cells):
                for k, a, b in zip(self.shown, old, new):
                    if a != b:
                        self.update_cell(str(r.pid), k, b)
            self._cells = cells
            return
        self.clear()
        self.pids = pids
        self._cells = cells
        for r, row in zip(rows, cells):
            self.add_row(*row, key=str(r.pid))
        if self.user_moved and selected in self.pids:
            self.move_cursor(row=self.pids.index(selected))

    def selected_pid(self) -> int | None:
        if not self.pids or self.cursor_row is None or not 0 <= self.cursor_row < len(self.pids):
            return None
        return self.pids[self.cursor_row]


class StatusLine(Static):
    DEFAULT_CSS = "StatusLine { height: auto; padding: 0 1; background: $panel; }"
