"""Shared by the checkpoint tests: a shimmed `pattern` workload to checkpoint (fills its device memory
from a seed and reports a checksum on command), and a 1 MiB tmpfs to fill."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from gputrace import simcuda
from gputrace.shim import client

from shimtest import start


class Target:
    def __init__(self, procs, size: int) -> None:
        self.p = start(procs, simcuda.workload("pattern") + ["--size", str(size)])
        line = self.p.stdout.readline()
        assert line, self.p.stderr.read()
        self.ready = json.loads(line)
        self.pid = self.p.pid

    def cmd(self, line: str) -> dict:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline()
        assert out, self.p.stderr.read()
        return json.loads(out)

    def sum(self) -> str:
        return self.cmd("sum")["sum"]

    def gate_open(self) -> bool:
        return client.status(self.pid)["paused"] is False


@pytest.fixture
def target(procs, shim_dir):
    """target(size) starts a shimmed pattern workload holding about 2.1 x size bytes of device memory."""
    return lambda size=1 << 20: Target(procs, size)



@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", str(d)], check=True)
