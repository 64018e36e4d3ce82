"""Modal dialogs: confirm an action, pick a checkpoint to restore, the key help."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, OptionList, Static
from textual.widgets.option_list import Option

from gputrace.hostview.model import Checkpoint
from ..text import fmt_checkpoint

_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: auto; max-width: 90%; height: auto; max-height: 90%; border: thick $accent;
                    background: $surface; padding: 1 2; }}
{name} Horizontal {{ height: auto; align-horizontal: right; margin-top: 1; }}
{name} Button {{ margin-left: 2; }}
"""


class ConfirmScreen(ModalScreen[bool]):
    # A question as wide as the screen allows, wrapped inside the border (an auto-width box let a long one
    # run past it, cut off).
    DEFAULT_CSS = _CSS.format(name="ConfirmScreen") + """
ConfirmScreen > Vertical { width: 90%; max-width: 100; }
ConfirmScreen #question { width: 100%; }
"""
    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="question")
            with Horizontal():
                yield Button("No [n]", id="no")
                yield Button("Yes [y]", id="yes", variant="warning")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class RestoreScreen(ModalScreen["str | None"]):
    DEFAULT_CSS = _CSS.format(name="RestoreScreen")
    BINDINGS = [Binding("escape,n", "cancel", "cancel")]

    def __init__(self, pid: int, comm: str, checkpoints: list[Checkpoint], whole: bool = True) -> None:
        super().__init__()
        self.pid, self.comm, self.whole = pid, comm, whole
        self.checkpoints = sorted(checkpoints, key=lambda c: -c.taken_at)

    def compose(self) -> ComposeResult:
        with Vertical():
            if self.whole:
                yield Label(f"Bring pid {self.pid} ({self.comm}) back, whole, to which checkpoint? (enter picks, esc "
                            "cancels)")
            else:
                yield Label(f"Roll only the device memory of pid {self.pid} ({self.comm}) back to which checkpoint? "
                            "(unsafe for jobs that reallocate; enter picks, esc cancels)")
            yield OptionList(*(Option(f"{c.id}  ({fmt_checkpoint(c)})", id=c.id) for c in self.checkpoints),
                             id="checkpoints")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP = """\
[b]gputrace top[/b] — every CUDA process, what interception would cost it, checkpoints at a key

[b]moving[/b]      ↑ ↓ PgUp PgDn   select a process      enter  its detail screen
[b]sorting[/b]     < >  previous / next sort column      i  invert the order   (or click a header)
[b]filtering[/b]   /  filter by command or pid ("shim": shimmed only)      esc  clear it
[b]preset[/b]      p  switch the interception preset the OVERHEAD column predicts for
[b]actions[/b]     each asks first, shows progress below the table, then the freeze (and the time back)
            c  checkpoint the whole process (GPU and CPU state, CRIU), left running; any process,
               shimmed or not (top takes its own probes off the job while CRIU copies it)
            r  restore: the running process replaced by a whole-process checkpoint of it
            on a shimmed process (started with `gputrace run --checkpointable`):
            s  suspend (--suspendable; the job waits)   u  resume   C  checkpoint device memory only
            R  roll back device memory alone (UNSAFE for jobs that reallocate; refused where seen)
            suspended (kept if top quits): c, C, R refused (u first); r brings it back running
            a job's rank: s, u act on every rank at once; c, r, C, R refused, naming the job's command
[b]other[/b]       ?  this help   q  quit   escape  back   ctrl+s  screenshot (SVG)   ctrl+p  command palette

OVERHEAD is lower–upper: the predicted slowdown if the layer's added CPU time hides in the time the
job waits for the GPU (lower), or shows in full (upper, with what a layer's code costs the caller's
own). DRIVER CPU and WAIT are shares of one second spent in driver calls that do not wait and in
those that wait for the GPU (synchronization, synchronous copies); summed over threads, so a job
whose threads make calls at once can show more than 100%, marked Σ.
"""


class HelpScreen(ModalScreen[None]):
    # A Static in an auto-width box has no width to wrap to and collapses: give the box one.
    DEFAULT_CSS = _CSS.format(name="HelpScreen") + "HelpScreen > Vertical { width: 108; }"
    BINDINGS = [Binding("escape,q,question_mark", "close", "close")]

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)

    def action_close(self) -> None:
        self.dismiss(None)
