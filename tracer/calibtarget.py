"""How the calibration target (calib.c) is built: gputrace.base.native.build's arguments, importable
without the rest of the tracer (the wheel's build step makes it ahead of time into `prebuilt`)."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

BUILD = dict(name="libgputrace_calib.so", sources=[_HERE / "calib.c"], shared=True, cflags=["-O1"],
             prebuilt=_HERE / "prebuilt")
