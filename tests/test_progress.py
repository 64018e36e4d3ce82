"""The progress line of long work: a bar, the bytes, the rate and the time left."""

from __future__ import annotations

import io
import sys

from gputrace.progress import BAR, Progress, progress_line


def test_the_line_has_a_bar_the_bytes_the_rate_and_the_time_left():
    line = progress_line("copy", 1 << 30, 4 << 30, 0.5)
    bar = line[line.index("[") + 1:line.index("]")]
    assert len(bar) == BAR and bar.count("#") == BAR // 4
    assert "1.0 GiB of 4.0 GiB" in line and " 25%" in line
    assert "2.15 GB/s" in line  # 2^30 bytes in 0.5 s
    assert "2 s left" in line  # 3 GiB more at that rate: 1.5 s, shown rounded


def test_no_rate_before_time_has_passed_and_no_time_left_when_done():
    assert "GB/s" not in progress_line("write", 0, 1 << 20, 0.0)
    done = progress_line("verify", 1 << 20, 1 << 20, 2.0)
    assert "100%" in done and "left" not in done and "GB/s" in done


def test_progress_draws_on_stderr_only_when_enabled(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    off = Progress(False)
    off("copy", 1, 2)
    off.end()
    assert err.getvalue() == ""
    on = Progress(True)
    on("copy", 1, 2)
    on("freeze", 0, 0)  # the freeze is reported apart, not drawn
    on("copy", 2, 2)
    on.end()
    text = err.getvalue()
    assert text.startswith("\rcopy") and text.endswith("\n") and "freeze" not in text
    assert text.count("\r") == 2 and "100%" in text
