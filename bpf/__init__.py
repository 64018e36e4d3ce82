"""The tracer's BPF program (counts.bpf.c, with gputrace.h and compat.h), shipped as package data.

It is compiled one of two ways (compat.h): by bcc at run time, or ahead of time by clang into the
object `OBJECT` describes (gputrace.base.native.build's arguments): built into the wheel by setup.py
(`prebuilt`), or at first use in a checkout where clang is installed. tracer/bpfobj.py loads it.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

OBJECT = dict(
    name="counts.bpf.o",
    sources=[_HERE / "counts.bpf.c"],
    headers=[_HERE / "gputrace.h", _HERE / "compat.h"],
    cflags=["-DGT_BPF_OBJECT"],
    target="bpf",
    prebuilt=_HERE / "prebuilt",
)
