"""The process table: a Line-API widget that keeps one rendered Strip per row.

Textual's DataTable keys its render caches on one update counter, so any cell update re-renders
every cell through Rich: a fifth of a core at 50 rows and 1 Hz. Here a row is a tuple of strings;
`show` compares each row's tuple with the one on screen, drops the cached Strip only of rows whose
text changed, and marks only their lines dirty. A refresh where nothing changed paints nothing.
"""

from __future__ import annotations

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from gputrace.hostview.model import ProcessRow
from .text import COLUMNS, overhead_level

LEFT = frozenset({"comm", "ckpt", "trend"})
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


class ProcessTable(ScrollView, can_focus=True):
    """One row per process, keyed by pid so the cursor stays on its process across refreshes. The
    first line is the header (it stays put when the rows scroll); clicking a title sorts by it."""

    COMPONENT_CLASSES = {"process-table--header", "process-table--cursor", "process-table--even-row",
                         "process-table--shim", "process-table--low", "process-table--mid", "process-table--high"}
    DEFAULT_CSS = """
    ProcessTable {
        height: 1fr;
        background: $surface;
        color: $foreground;
        & > .process-table--header { text-style: bold; background: $panel; color: $foreground; }
        & > .process-table--even-row { background: $surface-lighten-1 50%; }
        & > .process-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
        & > .process-table--shim { color: $success; }
        & > .process-table--low { color: $success; }
        & > .process-table--mid { color: $warning; }
        & > .process-table--high { color: $error; text-style: bold; }
        &:focus > .process-table--cursor {
            background: $block-cursor-background;
            color: $block-cursor-foreground;
            text-style: $block-cursor-text-style;
        }
        &:dark > .process-table--even-row { background: $surface-darken-1 40%; }
    }
    """
    BINDINGS = [
        Binding("up", "cursor_up", "up", show=False),
        Binding("down", "cursor_down", "down", show=False),
        Binding("pageup", "page_up", "page up", show=False),
        Binding("pagedown", "page_down", "page down", show=False),
        Binding("home", "first", "first", show=False),
        Binding("end", "last", "last", show=False),
    ]

    class HeaderSelected(Message):
        """A column title was clicked."""

        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

    class RowSelected(Message):
        """The row under the cursor was clicked again."""

        def __init__(self, pid: int) -> None:
            super().__init__()
            self.pid = pid

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.shown: tuple[str, ...] = ()
        self.titles: tuple[str, ...] = ()
        self.pids: list[int] = []
        self.texts: list[tuple[str, ...]] = []
        self.shimmed: list[bool] = []
        self.levels: list[str | None] = []  # each row's overhead level (text.overhead_level)
        self.cursor = 0
        # Until the user moves the cursor it stays on the top row (the costliest process, as
        # sorted); once moved, it follows the process it was put on through re-sorting.
        self.user_moved = False
        self._lines: dict[int, tuple[tuple, Strip]] = {}  # row index -> (what it was built from, strip)
        self._cells: dict[int, tuple[ProcessRow, str, tuple[str, ...]]] = {}  # pid -> (row, preset, cells)
        self._styles: tuple[Style, ...] = ()
        self._widths: dict[str, int] = {}
        self.strips_built = 0  # rows rendered since mount: what a refresh cost, for tests and benchmarks

    # --- data ---------------------------------------------------------------------------------
    def _width(self, k: str) -> int:
        return self._widths.get(k, 1)

    def set_columns(self, keys: tuple[str, ...], sort: str, reverse: bool) -> None:
        self.shown = keys
        self.titles = tuple(COLUMNS[k][0] + ((" ▲" if reverse else " ▼") if k == sort else "") for k in keys)
        self._widths = {k: cell_len(t) for k, t in zip(keys, self.titles)}
        self.texts = []  # columns changed: every row is new
        self._fit(self.texts)
        self._lines.clear()
        self._cells.clear()
        self.refresh()

    def _fit(self, texts: list[tuple[str, ...]]) -> bool:
        """Widens columns to their widest cell in `texts` (never narrows them between two
        set_columns, so the table does not jitter: rows whose text did not change cannot widen
        them); True if any width changed."""
        changed = False
        for i, k in enumerate(self.shown):
            w = max((cell_len(t[i]) for t in texts), default=0)
            if w > self._widths.get(k, 0):
                self._widths[k], changed = w, True
        self.virtual_size = Size(sum(self._width(k) + 2 for k in self.shown), len(self.pids) + 1)
        return changed

    def show(self, rows: list[ProcessRow], preset: str, now: float) -> None:
        """Puts `rows` on screen, repainting only the lines whose text changed."""
        selected = self.selected_pid()
        texts = [self._row_cells(r, preset, now) for r in rows]
        self._cells = {r.pid: self._cells[r.pid] for r in rows}
        pids = [r.pid for r in rows]
        shimmed = [r.shimmed for r in rows]
        levels = [overhead_level(r, preset) for r in rows]
        dirty = [i for i in range(max(len(texts), len(self.texts)))
                 if i >= len(texts) or i >= len(self.texts) or texts[i] != self.texts[i] or shimmed[i] != self.shimmed[i]
                 or levels[i] != self.levels[i]]
        self.pids, self.texts, self.shimmed, self.levels = pids, texts, shimmed, levels
        if self._fit([texts[i] for i in dirty if i < len(texts)]):
            self._lines.clear()
            dirty = list(range(-1, len(texts)))
        old_cursor = self.cursor
        if self.user_moved and selected in pids:
            self.cursor = pids.index(selected)
        elif not self.user_moved:
            self.cursor = 0
        self.cursor = max(0, min(self.cursor, len(pids) - 1))
        if self.cursor != old_cursor:
            dirty += [old_cursor, self.cursor]
            self._scroll_to_cursor()
        self._repaint(dirty)

    def _row_cells(self, r: ProcessRow, preset: str, now: float) -> tuple[str, ...]:
        """The row's cells; the same row object (a refresh without new figures for its process)
        gives the same cells, unless it shows a checkpoint's age, which moves with `now`."""
        cached = self._cells.get(r.pid)
        if cached is not None and cached[0] is r and cached[1] == preset and r.last_checkpoint is None:
            return cached[2]
        cells = tuple(COLUMNS[k][1](r, preset, now) for k in self.shown)
        self._cells[r.pid] = (r, preset, cells)
        return cells

    def _repaint(self, rows: list[int]) -> None:
        top = self.scroll_offset.y
        width, height = self.size
        lines = [y for y in {0 if i < 0 else i - top + 1 for i in rows} if 0 <= y < height]
        if lines:  # one refresh for all of them: each call has its own bookkeeping in Textual
            self.refresh(*(Region(0, y, width, 1) for y in lines))

    def selected_pid(self) -> int | None:
        if not self.pids or not 0 <= self.cursor < len(self.pids):
            return None
        return self.pids[self.cursor]

    def row_texts(self, pid: int) -> dict[str, str]:
        """The cells shown for `pid`, by column key."""
        return dict(zip(self.shown, self.texts[self.pids.index(pid)]))

    # --- rendering ----------------------------------------------------------------------------
    def render_lines(self, crop: Region) -> list[Strip]:
        styles = tuple(self.get_component_rich_style(c) for c in (
            "process-table--header", "process-table--cursor", "process-table--even-row", "process-table--shim",
            "process-table--low", "process-table--mid", "process-table--high"))
        styles += (self.rich_style,)
        if styles != self._styles:  # the theme, or focus (the cursor's colour) changed
            self._styles = styles
            self._lines.clear()
        return super().render_lines(crop)

    def _build(self, cells: tuple[str, ...], style: Style, shimmed: bool, width: int,
               level: str | None = None) -> Strip:
        """One line, padded to `width`: one segment, and one more around each coloured cell (a
        shimmed row's SHIM, the OVERHEAD by its level): fewer segments are less for every later
        stage of Textual's rendering to go through."""
        parts = []
        coloured: dict[int, Style] = {}
        for k, text in zip(self.shown, cells):
            w = self._width(k)
            pad = w - cell_len(text)
            text = set_cell_size(text, w) if pad < 0 else (text + " " * pad if k in LEFT else " " * pad + text)
            if k == "shim" and shimmed:
                coloured[len(parts)] = self._styles[3]
            elif k == "overhead" and level is not None:
                coloured[len(parts)] = self._styles[4 + ("low", "mid", "high").index(level)]
            parts.append(f" {text} ")
        length = sum(self._width(k) + 2 for k in self.shown)
        if length < width:
            parts.append(" " * (width - length))
            length = width
        self.strips_built += 1
        if not coloured:
            return Strip([Segment("".join(parts), style)], length)
        segs, start = [], 0
        for i in sorted(coloured):
            c = coloured[i]  # the row's background, the cell's colour (and weight)
            segs += [Segment("".join(parts[start:i]), style), Segment(parts[i], style + Style(color=c.color, bold=c.bold))]
            start = i + 1
        segs.append(Segment("".join(parts[start:]), style))
        return Strip([s for s in segs if s.text], length)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        scroll_x, top = self.scroll_offset
        header, cursor, even, base = self._styles[0], self._styles[1], self._styles[2], self._styles[-1]
        if y == 0:
            key: tuple = ("header", self.titles, scroll_x, width)
            style = base + header
            index, build = -1, lambda: self._build(self.titles, style, False, scroll_x + width)
        else:
            index = top + y - 1
            if index >= len(self.texts):
                return Strip.blank(width, base)
            kind = "cursor" if index == self.cursor else ("even" if index % 2 else "odd")
            style = base + (cursor if kind == "cursor" else even if kind == "even" else Style())
            cells, shim, level = self.texts[index], self.shimmed[index], self.levels[index]
            key = (cells, shim, level, kind, scroll_x, width)
            build = lambda: self._build(cells, style, shim, scroll_x + width, level)  # noqa: E731
        cached = self._lines.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        strip = build().crop(scroll_x, scroll_x + width).adjust_cell_length(width, style)
        self._lines[index] = (key, strip)
        return strip

    # --- keys and mouse -----------------------------------------------------------------------
    def _move(self, row: int) -> None:
        self.user_moved = True
        if not self.pids:
            return
        row = max(0, min(row, len(self.pids) - 1))
        if row != self.cursor:
            old, self.cursor = self.cursor, row
            self._scroll_to_cursor()
            self._repaint([old, row])

    def _page(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def _scroll_to_cursor(self) -> None:
        top, page = self.scroll_offset.y, self._page()
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + page:
            self.scroll_to(y=self.cursor - page + 1, animate=False)

    def action_cursor_up(self) -> None:
        self._move(self.cursor - 1)

    def action_cursor_down(self) -> None:
        self._move(self.cursor + 1)

    def action_page_up(self) -> None:
        self._move(self.cursor - self._page())

    def action_page_down(self) -> None:
        self._move(self.cursor + self._page())

    def action_first(self) -> None:
        self._move(0)

    def action_last(self) -> None:
        self._move(len(self.pids) - 1)

    def on_click(self, event: events.Click) -> None:
        x = event.x + self.scroll_offset.x
        if event.y == 0:
            edge = 0
            for k in self.shown:
                edge += self._width(k) + 2
                if x < edge:
                    self.post_message(self.HeaderSelected(k))
                    return
            return
        row = self.scroll_offset.y + event.y - 1
        if 0 <= row < len(self.pids):
            if row == self.cursor and self.user_moved:
                self.post_message(self.RowSelected(self.pids[row]))
            self._move(row)
