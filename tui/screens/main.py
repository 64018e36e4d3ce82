"""The main screen: the host header, one row per process, the filter and the action status line."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Input

from gputrace.hostview.model import HostSnapshot, ProcessRow
from ..text import SORTABLE, matches, sort_rows
from ..widgets import HostHeader, ProcessTable, StatusLine, columns_for


class MainScreen(Screen):
    BINDINGS = [
        Binding("enter", "detail", "detail", show=True),
        Binding("slash", "filter", "filter"),
        Binding("less_than_sign", "sort(-1)", "sort ←", show=False),
        Binding("greater_than_sign", "sort(1)", "sort →"),
        Binding("i", "invert", "invert", show=False),
        Binding("p", "preset", "preset"),
        Binding("c", "act('checkpoint_full')", "checkpoint"),
        Binding("r", "act('restore_full')", "restore"),
        Binding("s", "act('suspend')", "suspend"),
        Binding("u", "act('resume')", "resume"),
        Binding("C", "act('checkpoint')", "device ckpt", show=False),
        Binding("R", "act('rollback')", "device-only rollback", show=False),
        Binding("w", "act('checkpoint_full')", "checkpoint", show=False),
        Binding("escape", "clear_filter", "clear filter", show=False),
    ]
    DEFAULT_CSS = """
    MainScreen Input { dock: bottom; display: none; }
    MainScreen Input.shown { display: block; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.sort = "overhead"
        self.reverse = False
        self.filter = ""
        self.rows: list[ProcessRow] = []

    def compose(self) -> ComposeResult:
        yield HostHeader(id="header")
        yield ProcessTable(id="processes")
        yield StatusLine("", id="status")
        yield Input(placeholder="filter: command or pid, 'shim' for shimmed ones; enter keeps it, esc clears",
                    id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self._columns()
        self.show_frame(self.app.frame)
        self.query_one(ProcessTable).focus()

    def on_resize(self, event: events.Resize) -> None:
        self._columns()
        self.show_frame(self.app.frame)

    def _columns(self) -> None:
        self.query_one(ProcessTable).set_columns(columns_for(self.size.width or 80), self.sort, self.reverse)

    # --- data ----------------------------------------------------------------------------------
    def show_frame(self, frame: HostSnapshot | None) -> None:
        app = self.app
        self.query_one(HostHeader).show(frame, app.preset, self.sort, self.reverse, self.filter, app.state)
        if frame is None:
            return
        rows = [app.with_overrides(r) for r in frame.processes if matches(r, self.filter)]
        self.rows = sort_rows(tuple(rows), self.sort, app.preset, self.reverse)
        table = self.query_one(ProcessTable)
        table.show(self.rows, app.preset, frame.t)
        empty = "no CUDA process measured yet"
        status = self.query_one("#status")
        if not frame.processes:
            self.set_status(empty + (f" ({len(frame.pending)} attaching)" if frame.pending else ""))
        elif str(status.render()).startswith(empty):
            self.set_status("")

    def set_status(self, text: str) -> None:
        self.query_one(StatusLine).update(text)

    def selected(self) -> ProcessRow | None:
        pid = self.query_one(ProcessTable).selected_pid()
        return next((r for r in self.rows if r.pid == pid), None)

    # --- keys ----------------------------------------------------------------------------------
    def action_detail(self) -> None:
        row = self.selected()
        if row is not None:
            from .detail import DetailScreen

            self.app.push_screen(DetailScreen(row.pid))

    def on_process_table_row_selected(self, event: ProcessTable.RowSelected) -> None:
        self.action_detail()

    def on_process_table_header_selected(self, event: ProcessTable.HeaderSelected) -> None:
        if event.key in SORTABLE:
            if event.key == self.sort:
                self.reverse = not self.reverse
            else:
                self.sort, self.reverse = event.key, False
            self._resort()

    def action_sort(self, step: int) -> None:
        keys = [k for k in SORTABLE if k in self.query_one(ProcessTable).shown] or list(SORTABLE)
        i = keys.index(self.sort) if self.sort in keys else 0
        self.sort, self.reverse = keys[(i + step) % len(keys)], False
        self._resort()

    def action_invert(self) -> None:
        self.reverse = not self.reverse
        self._resort()

    def _resort(self) -> None:
        self._columns()
        self.show_frame(self.app.frame)

    def action_preset(self) -> None:
        self.app.next_preset()

    def action_filter(self) -> None:
        box = self.query_one(Input)
        box.add_class("shown")
        box.value = self.filter
        # Focus now, not via focus()'s call_later: keys typed right after '/' (a paste, a fast typist,
        # tmux send-keys) would otherwise reach the table and run its single-key actions.
        self.set_focus(box)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter = event.value
        self.show_frame(self.app.frame)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.remove_class("shown")
        self.query_one(ProcessTable).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one(Input)
        box.value = ""
        box.remove_class("shown")
        self.filter = ""
        self.query_one(ProcessTable).focus()
        self.show_frame(self.app.frame)

    def key_escape(self) -> None:
        # The Input swallows escape's binding while focused; clear from here too.
        if self.query_one(Input).has_focus:
            self.action_clear_filter()

    def action_act(self, action: str) -> None:
        row = self.selected()
        if row is None:
            self.app.bell()
            return
        self.app.request_action(action, row)
