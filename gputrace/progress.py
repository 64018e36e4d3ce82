"""Progress of long work (checkpoint, restore, suspend, whole-job) on stderr: a bar, the bytes, the
rate and the time left, for a terminal only, at most ten updates a second."""

from __future__ import annotations

import sys
import time

from .base.units import fmt_bytes

BAR = 24  # characters


def progress_line(phase: str, done: int, total: int, elapsed_s: float) -> str:
    """One line: `copy  [#########...............]  1.2 GiB of 3.0 GiB  41%  2.10 GB/s  1 s left`
    (rate and time left once a first part of the phase has taken measurable time)."""
    share = min(1.0, done / total) if total else 1.0
    full = int(round(share * BAR))
    line = f"{phase:<8}[{'#' * full}{'.' * (BAR - full)}]  {fmt_bytes(done)} of {fmt_bytes(total)}  {100 * share:3.0f}%"
    if elapsed_s > 0.05 and done > 0:
        rate = done / elapsed_s
        line += f"  {rate / 1e9:.2f} GB/s"
        if done < total:
            left = (total - done) / rate
            line += f"  {left:.0f} s left" if left >= 1 else "  <1 s left"
    return line


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
