"""Progress of long work (checkpoint, restore, suspend, whole-job) on stderr: a bar, the bytes, the
rate and the time left, for a terminal only, at most ten updates a second."""

from __future__ import annotations

import sys
import time


from .base.progress import BAR, progress_line  # noqa: F401  (the line is the UI's too)


class Progress:
    """A progress callback (phase, done, total) drawing progress_line on stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.last = 0.0
        self.shown = False
        self.phase: str | None = None
        self.phase_t0 = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled or phase == "freeze":
            return
        now = time.monotonic()
        if phase != self.phase:
            self.phase, self.phase_t0 = phase, now
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        sys.stderr.write("\r" + progress_line(phase, done, total, now - self.phase_t0) + "  ")
        sys.stderr.flush()
        self.shown = True

    def end(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            self.shown = False
