"""What a probe hit costs on this host, measured against calibration targets of our own.

A C loop calls a near-empty function n times. Run unprobed, with an entry probe, and with entry and
return probes, rounds interleaved; the per-call differences are the cost a hit adds to the traced
thread. The time the BPF program measures for the near-empty function is the bias inside every
timed call (probe work between the two timestamps), which the tracer subtracts from per-call times.

The cost depends on the probed function's first instruction: x86 uprobes emulate a register push,
branches and nop, and single-step anything else out of line, which costs another trap (five times
the cost on a virtual machine). So there are two targets, and each function is charged by its kind.
"""

from __future__ import annotations

import ctypes
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from gputrace.base import native
from gputrace.base.arch import decodes_first_instruction

from . import calibtarget
from .bpfprog import COOKIE_TIMED, Program
from .symbols import read_functions

CALIB_FUNC_ID = 0xFFFFFFF0  # a function id no libcuda function gets
KINDS = ("emulated", "stepped")


@dataclass(frozen=True)
class ProbeCost:
    entry_ns: float         # cost a hit of an entry-only probe adds to the traced thread
    entry_return_ns: float  # cost of a timed call (entry and return probes)
    bias_ns: float          # what a timed call's measured duration overstates
    rel_spread: float = 0.0 # half the range of the rounds' entry costs, relative: how far to trust them

    def cost_ns(self, timed: bool) -> float:
        return self.entry_return_ns if timed else self.entry_ns


@dataclass(frozen=True)
class Calibration:
    emulated: ProbeCost     # functions whose first instruction the kernel emulates
    stepped: ProbeCost      # functions whose first instruction is single-stepped
    base_ns: float          # the near-empty call itself, unprobed
    rounds: int
    calls_per_round: int

    def of(self, kind: str) -> ProbeCost:
        return self.emulated if kind == "emulated" else self.stepped


def probe_kind(path: str | os.PathLike, offset: int) -> str:
    """"emulated" or "stepped": how the kernel will execute the probed first instruction (decoded
    on x86-64; elsewhere "stepped", the dearer kind, so that a budget errs on the safe side)."""
    if not decodes_first_instruction():
        return "stepped"
    with open(path, "rb") as f:
        f.seek(offset)
        b = f.read(2).ljust(2, b"\0")
    b0, b1 = b[0], b[1]
    if 0x50 <= b0 <= 0x57 or (b0 == 0x41 and 0x50 <= b1 <= 0x57):  # push reg
        return "emulated"
    if b0 in (0xE8, 0xE9, 0xEB, 0x90) or 0x70 <= b0 <= 0x7F or (b0 == 0x0F and 0x80 <= b1 <= 0x8F):
        return "emulated"  # call, jmp, nop, conditional jumps
    return "stepped"


def target_library() -> Path:
    return native.build(**calibtarget.BUILD)


def calibrate(program: Program, *, rounds: int = 5, round_s: float = 0.02) -> Calibration:
    path = target_library()
    lib = ctypes.CDLL(str(path))
    lib.gt_calib_loop.restype = ctypes.c_uint64
    lib.gt_calib_loop.argtypes = [ctypes.c_int, ctypes.c_uint64]
    funcs = {f.name: f for f in read_functions(path, prefix="gt_calib_")}
    pid = os.getpid()
    key = (pid, CALIB_FUNC_ID)

    def loop(which: int, n: int) -> float:
        return lib.gt_calib_loop(which, n) / n

    def probed(which: int, n: int, timed: bool) -> tuple[float, float]:
        fn = funcs["gt_calib_stepped" if which else "gt_calib_emulated"]
        program.next_generation()
        cookie = CALIB_FUNC_ID | (COOKIE_TIMED if timed else 0)
        ret = program.attach(str(path), [fn.offset], [cookie], retprobe=True, pid=pid) if timed else None
        ent = program.attach(str(path), [fn.offset], [cookie], retprobe=False, pid=pid)
        program.open()
        try:
            per_call = loop(which, n)
        finally:
            program.close_counting()
            ent.close()
            if ret:
                ret.close()
        st = program.read_stats().get(key)
        program.forget([key])
        return per_call, (st.total_ns / st.timed if st and st.timed else 0.0)

    loop(0, 10000)  # fault in, warm caches
    loop(1, 10000)
    slowest, _ = probed(1, 200, True)
    n = max(200, min(2_000_000, int(round_s / max(slowest * 1e-9, 1e-9))))
    costs = {}
    bases = []
    for which, kind in enumerate(KINDS):
        base, entry, both, inside = [], [], [], []
        for _ in range(rounds):
            base.append(loop(which, n))
            entry.append(probed(which, n, False)[0])
            t, m = probed(which, n, True)
            both.append(t)
            inside.append(m)
        b = statistics.median(base)
        bases.append(b)
        e = max(1e-9, statistics.median(entry) - b)
        costs[kind] = ProbeCost(
            entry_ns=e,
            entry_return_ns=max(0.0, statistics.median(both) - b),
            bias_ns=max(0.0, statistics.median(inside) - b),
            rel_spread=(max(entry) - min(entry)) / 2 / e,
        )
    return Calibration(costs["emulated"], costs["stepped"], statistics.median(bases), rounds, n)
