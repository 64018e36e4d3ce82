"""One line of progress for long work (checkpoint, restore, suspend, whole-job): a bar, the bytes,
the rate and the time left. The CLI draws it on stderr (gputrace/progress.py), `top` in its status."""

from __future__ import annotations

from .units import fmt_bytes

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
