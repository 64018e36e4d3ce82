"""What workers tell the UI: dataclass messages, posted from threads, handled on the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from gputrace.hostview.checkpoints import ActionResult
from gputrace.hostview.model import HostSnapshot


@dataclass
class FrameArrived(Message):
    frame: HostSnapshot


@dataclass
class SourceEnded(Message):
    error: str | None = None   # None: the source ran out (a replay's end)
    hint: str = ""


@dataclass
class ActionProgress(Message):
    pid: int
    action: str
    fraction: float
    text: str


@dataclass
class ActionDone(Message):
    result: ActionResult


@dataclass
class ActionFailed(Message):
    pid: int
    action: str
    error: str
    hint: str = ""
