"""Where HostSnapshots come from: the `Source` protocol, a recorded session's replay, and its writer.

A recorded session is JSON lines (orjson): a header `{"schema": 1, "kind": "gputrace.record", ...}`,
then one `gputrace.top.frame` object per refresh (hostview/model.py's `host_dict`). A reader refuses a
file of another kind or a newer schema with a hint, never a traceback.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import IO, Iterator, Protocol

import orjson

from gputrace.base.errors import GputraceError, UsageError

from .model import KIND_FRAME, KIND_RECORD, SCHEMA, HostSnapshot, host_dict, host_from_dict


class Source(Protocol):
    """Yields a HostSnapshot per refresh, blocking in between; `close()` ends the iteration soon
    (from any thread). `live` says whether the processes shown exist now (actions make sense)."""

    live: bool

    def frames(self) -> Iterator[HostSnapshot]: ...
    def close(self) -> None: ...


class ReplaySource:
    """Frames of a recorded session, paced as recorded (`speed` times faster; 0: no pause at all)."""

    live = False

    def __init__(self, path: str, speed: float = 1.0) -> None:
        self.path = path
        self.speed = speed
        self.header, self._frames = read_record(path)
        self._stop = threading.Event()

    def frames(self) -> Iterator[HostSnapshot]:
        prev = None
        for f in self._frames:
            if self._stop.is_set():
                return
            if prev is not None and self.speed > 0 and self._stop.wait(max(0.0, (f.t - prev) / self.speed)):
                return
            prev = f.t
            yield f

    def close(self) -> None:
        self._stop.set()

    def __len__(self) -> int:
        return len(self._frames)


def read_record(path: str) -> tuple[dict, list[HostSnapshot]]:
    hint = "give a file written by `gputrace record -o FILE`"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}", hint) from None
    lines = [ln for ln in data.splitlines() if ln.strip()]
    if lines and not data.endswith(b"\n") and len(lines) > 1:
        lines.pop()  # the recorder was killed mid-line: every whole line before it stands
    try:
        docs = [orjson.loads(ln) for ln in lines]
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"{path} is not a gputrace recording: {exc}", hint) from None
    if not docs or not isinstance(docs[0], dict) or docs[0].get("kind") != KIND_RECORD:
        raise UsageError(f"{path} is not a gputrace recording (no gputrace.record header)", hint)
    if docs[0].get("schema", 0) > SCHEMA:
        raise UsageError(f"{path} has schema {docs[0].get('schema')}, newer than this gputrace reads ({SCHEMA})",
                         "upgrade gputrace to replay it")
    try:
        frames = [host_from_dict(d) for d in docs[1:] if d.get("kind") == KIND_FRAME]
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path} has a malformed frame ({type(exc).__name__}: {exc})", hint) from None
    return docs[0], frames


class Recorder:
    """Writes a session: the header at once, then each frame as one line, flushed (a recording cut
    short by Ctrl-C or a kill is still readable up to its last whole line)."""

    def __init__(self, out: IO[bytes], options: dict) -> None:
        self.out = out
        self.frames = 0
        self._write({"schema": SCHEMA, "kind": KIND_RECORD, "host": socket.gethostname(), "started": time.time(),
                     "pid": os.getpid(), "options": options})

    def _write(self, doc: dict) -> None:
        self.out.write(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS) + b"\n")
        self.out.flush()

    def frame(self, h: HostSnapshot) -> None:
        self._write(host_dict(h))
        self.frames += 1


def write_record(path: str, frames: list[HostSnapshot], options: dict | None = None) -> None:
    """A recording from frames in hand (tests, fixtures)."""
    try:
        with open(path, "wb") as f:
            rec = Recorder(f, options or {})
            for h in frames:
                rec.frame(h)
    except OSError as exc:
        raise GputraceError(f"cannot write {path}: {exc.strerror}", "choose a writable path for -o") from None
