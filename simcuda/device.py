"""The simulated device (simcuda/device.c): device memory outside the processes that use it.

    with simcuda.device.Device(tmp_path) as dev:
        subprocess.Popen(cmd, env=dev.env(simcuda.env()))   # SIMCUDA_DEVICE=dev.socket

A process in device mode holds a connection to the daemon (its "/dev/nvidia*"; CRIU refuses to dump
it) and maps its device memory from files the daemon owns; the driver's checkpoint API
(cuCheckpointProcessCheckpoint) moves that memory into the process and drops the connection, after which
CRIU can dump the process, as on a GPU machine.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Mapping

from gputrace.base.native import build

_HERE = Path(__file__).resolve().parent


def daemon_path() -> Path:
    return build("simcuda-device", [_HERE / "device.c"])


class Device:
    """A running simcuda-device daemon serving `root/device.sock`, its memory under `root/mem`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.socket = self.root / "device.sock"
        self.mem = self.root / "mem"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Device":
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([str(daemon_path()), str(self.socket), str(self.mem)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline()  # "ready" once it accepts connections (or EOF if it failed)
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"simcuda-device did not start (exit status {self.proc.returncode})")
        return self

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        return {**base, "SIMCUDA_DEVICE": str(self.socket)}

    def files(self) -> list[Path]:
        """The device memory held now, one file per allocation."""
        return sorted(self.mem.glob("mem-*")) if self.mem.is_dir() else []

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        if self.proc and self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> "Device":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def env(base: Mapping[str, str], socket: os.PathLike) -> dict[str, str]:
    return {**base, "SIMCUDA_DEVICE": str(socket)}
