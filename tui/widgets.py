"""The dashboard's widgets: the host header, the action status line, and the process table
(tui/table.py)."""

from __future__ import annotations

import time

from rich.segment import Segment
from rich.text import Text
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from gputrace.base.units import fmt_pct

from gputrace.hostview.model import Gpu, HostSnapshot
from .table import ProcessTable, columns_for  # noqa: F401  (the screens import them from here)
from .text import COLUMNS, fmt_bytes, job_line


def bar(share: float | None, width: int = 10) -> str:
    """A share 0..1 as a bar of `width` cells in eighths; spaces where not known."""
    if share is None:
        return " " * width
    eighths = round(max(0.0, min(1.0, share)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")).ljust(width, "░")


def gpu_line(g: Gpu, traced: set[int]) -> Text:
    """One GPU of the panel: utilization and memory as bars, the processes on it and how many are traced."""
    t = Text("  ")
    t.append(f"GPU{g.index} ", style="bold")
    t.append(f"{g.name:<22.22} ")
    util = None if g.util_pct is None else g.util_pct / 100
    t.append("util ")
    t.append(bar(util), style="green" if util is not None and util >= 0.5 else "yellow")
    t.append(f" {'-' if util is None else f'{g.util_pct:.0f}%':>4}   mem ")
    mem = (g.mem_used_bytes / g.mem_total_bytes if g.mem_used_bytes is not None and g.mem_total_bytes else None)
    t.append(bar(mem), style="cyan")
    t.append(f" {fmt_bytes(g.mem_used_bytes)} / {fmt_bytes(g.mem_total_bytes)}   ")
    on = [pid for pid, _ in g.processes]
    t.append(f"{len(on)} process{'es' if len(on) != 1 else ''}"
             + (f" ({len(traced.intersection(on))} traced)" if on else ""), style="dim" if not on else "")
    return t


class HostHeader(Widget):
    """Paragraphs (the host; a line per GPU; the tracer, the counts and the clock), drawn as a Static draws
    them (a test holds them equal at every width) but through the Line API: the clock changes the
    second paragraph every refresh and the first rarely, and a Static renders all of its text
    through Textual's Content pipeline on every update (a quarter of the UI thread's CPU in `top`
    with 50 processes); here only the lines of a paragraph whose text changed are built, with
    Rich, and repainted."""

    DEFAULT_CSS = "HostHeader { height: auto; padding: 0 1; background: $boost; }"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._paras: list[Text] = [Text()]
        self._strips: dict[int, tuple[tuple, list[Strip]]] = {}  # paragraph -> (what it was built from, lines)

    def render(self) -> Text:
        return Text("\n").join(self._paras)

    def show(self, h: HostSnapshot | None, preset: str, sort: str, reverse: bool, filt: str, state: str) -> None:
        if h is None:
            self._set([Text(f"gputrace top — {state or 'starting: loading the BPF program and calibrating ...'}")])
            return
        t = Text()
        t.append(h.host, style="bold")
        if not h.gpus:
            t.append(f"  GPUs: none ({h.gpu_note})", style="dim")
        traced = {r.pid for r in h.processes}
        gpus = [gpu_line(g, traced) for g in h.gpus]
        u = Text()
        u.append(f"tracer at most {fmt_pct(h.tracer_overhead)} of a job's time (budget {fmt_pct(h.budget, 1)})  ")
        u.append(f"{len(h.processes)} processes", style="bold")
        if h.pending:
            u.append(f", {len(h.pending)} attaching")
        if h.notes:
            u.append(f", {len(h.notes)} not traceable", style="yellow")
        u.append(f"  preset {preset}  sort {COLUMNS[sort][0].lower()}{' ↑' if reverse else ''}")
        if filt:
            u.append(f"  filter '{filt}'", style="cyan")
        u.append(f"  {time.strftime('%H:%M:%S', time.localtime(h.t))}")
        if state:
            u.append(f"  {state}", style="yellow")
        jobs = [Text(job_line(j), style="cyan") for j in h.jobs(preset)]  # ranks of one job, as one
        self._set([t, *gpus, u, *jobs])

    @staticmethod
    def _key(para: Text) -> tuple:
        return para.plain, tuple(para.spans), para.style

    def _set(self, paras: list[Text]) -> None:
        width = self.size.width
        if width <= 0:
            self._paras = paras
            self.refresh(layout=True)
            return
        before = [(self._key(p), len(self._lines(i, width))) for i, p in enumerate(self._paras)]
        self._paras = paras
        heights = [len(self._lines(i, width)) for i in range(len(paras))]
        if heights != [n for _, n in before]:
            self.refresh(layout=True)  # its height changed (a paragraph wraps to more or fewer lines)
            return
        y, changed = 0, []
        for i, para in enumerate(paras):
            if self._key(para) != before[i][0]:
                changed.append(Region(0, y, width, heights[i]))
            y += heights[i]
        if changed:
            self.refresh(*changed)

    def _lines(self, i: int, width: int) -> list[Strip]:
        para = self._paras[i]
        base = self.visual_style.rich_style
        key = (self._key(para), width, base)
        cached = self._strips.get(i)
        if cached is None or cached[0] != key:
            console = self.app.console
            strips = []
            if para.cell_len <= width:
                lines = [para]
            else:
                lines = para.wrap(console, max(1, width))
                for line in lines:
                    line.rstrip()  # as Textual's wrapping leaves a line it breaks
            for line in lines:
                segs = [Segment(s.text, base + s.style if s.style else base) for s in line.render(console) if s.text]
                strips.append(Strip(segs))
            cached = self._strips[i] = (key, strips)
        return cached[1]

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return sum(len(self._lines(i, width)) for i in range(len(self._paras)))

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        for i in range(len(self._paras)):
            lines = self._lines(i, width)
            if y < len(lines):
                return lines[y]
            y -= len(lines)
        return Strip.blank(width, self.visual_style.rich_style)


class StatusLine(Static):
    DEFAULT_CSS = "StatusLine { height: auto; padding: 0 1; background: $panel; }"
