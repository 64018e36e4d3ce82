"""The exact calls of a simcuda `phases` job, for holding a tracer's figures against them.

`start_phases` starts one (running past its first driver calls when it returns); its `--log` file,
written at its exit, gives every function's cumulative count every millisecond against
CLOCK_MONOTONIC, which `PhaseLog.calls(a, b)` turns into the calls made in any span (the tracer's
reports carry their start on the same clock: attach's `started_monotonic_s`)."""

from __future__ import annotations

import bisect
import json
import os
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from . import env as simcuda_env
from . import workload


def phases_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """simcuda's environment with launches that cost nothing on the CPU (the phases set the pace)."""
    e = simcuda_env(base)
    e["SIMCUDA_LAUNCH_NS"] = "0"
    return e


def start_phases(phases: list[str], log: Path, held: bool = False, env: Mapping[str, str] | None = None,
                 extra: Sequence[str] = (), **popen) -> subprocess.Popen:
    """A phases job (SPEC strings as `--phase` takes them), running when this returns; `held`: its
    phases start only once a line is written to its stdin; `extra`: more of its options (`--side`)."""
    r, w = os.pipe()
    argv = workload("phases") + sum((["--phase", p] for p in phases), []) + ["--log", str(log), "--ready-fd", str(w)]
    argv += list(extra)
    argv += ["--wait-stdin"] if held else []
    p = subprocess.Popen(argv, env=dict(env) if env is not None else phases_env(), pass_fds=(w,),
                         stdin=subprocess.PIPE if held else None, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, **popen)
    os.close(w)
    with os.fdopen(r) as ready:
        if ready.readline() != "ready\n":
            out, err = p.communicate()
            raise RuntimeError(f"simcuda phases did not start: {err.strip() or out.strip()}")
    return p


class PhaseLog:
    """A phases job's log: calls of each function in any span."""

    def __init__(self, path: Path) -> None:
        d = json.loads(Path(path).read_text())
        self.names, self.t, self.counts = d["names"], d["t"], d["counts"]

    def at(self, x: float) -> list[float]:
        i = bisect.bisect_left(self.t, x)
        if i <= 0:
            return [float(c) for c in self.counts[0]]
        if i >= len(self.t):
            return [float(c) for c in self.counts[-1]]
        t0, t1 = self.t[i - 1], self.t[i]
        fr = (x - t0) / (t1 - t0) if t1 > t0 else 0.0
        return [a + (b - a) * fr for a, b in zip(self.counts[i - 1], self.counts[i])]

    def calls(self, a: float, b: float) -> dict[str, float]:
        ca, cb = self.at(a), self.at(b)
        return {n: cb[k] - ca[k] for k, n in enumerate(self.names)}
