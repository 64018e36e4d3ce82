"""Shared by the shim tests: fixtures for processes and a private socket directory, and the comparison
of a workload's own view of its allocations with the shim's."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from gputrace import shim, simcuda

KINDS = {1: "device", 2: "pitch", 3: "async", 4: "host", 5: "va_reserve", 6: "vmm_phys", 7: "vmm_map"}


@pytest.fixture
def procs(spawned):
    """The shim tests' name for conftest's `spawned`: started processes, killed at teardown."""
    return spawned


@pytest.fixture
def shim_dir(tmp_path, monkeypatch):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("GPUTRACE_SHIM_DIR", str(d))
    return d


def start(procs, argv, **kw) -> subprocess.Popen:
    p = subprocess.Popen(argv, env=shim.preload_env(simcuda.env()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, **kw)
    procs.append(p)
    return p


def expected_allocs(held: dict) -> set:
    out = set()
    for a in held["allocations"]:
        kind = KINDS[a["kind"]]
        extra = (a["handle"],) if kind == "vmm_phys" else (a["handle"], a["offset"], a["access"]) if kind == "vmm_map" else ()
        out.add((kind, a["base"], a["size"], *extra))
    return out


def reported_allocs(st: dict) -> set:
    out = set()
    for a in st["allocations"]:
        kind = a["kind"]
        extra = (a["handle"],) if kind == "vmm_phys" else (a["handle"], a["offset"], a["access"]) if kind == "vmm_map" else ()
        out.add((kind, a["base"], a["size"], *extra))
    return out


def open_files(pid: int) -> list[str]:
    """What process `pid`'s descriptors point at (readlink of /proc/PID/fd/*; ones closed meanwhile left out)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def start_pattern(procs, *args: str, vmm: bool = True) -> subprocess.Popen:
    """simcuda's `pattern` workload under the shim (its cuMemAlloc served through the VMM API unless
    `vmm` is False), answering commands on stdin."""
    env = shim.preload_env(simcuda.env())
    if vmm:
        env["GPUTRACE_SHIM_VMM"] = "1"
    p = subprocess.Popen(simcuda.workload("pattern") + list(args), env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    return p


def ask(p, line: str) -> dict:
    """One command to a workload on its stdin; its one-line JSON reply."""
    p.stdin.write(line + "\n")
    p.stdin.flush()
    out = p.stdout.readline()
    assert out, p.stderr.read()
    return json.loads(out)
