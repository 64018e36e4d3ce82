"""GPUs through nvidia-ml-py: a stand-in `pynvml` with two devices (one whose utilization NVML does
not give, one process whose memory it hides) and the frames read from it; the panel's lines."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace as NS

import pytest

from gputrace.hostview import gpus
from gputrace.hostview.model import Gpu, host_dict, host_from_dict
from gputrace.tui.widgets import bar, gpu_line
from topdata import frame


def fake_nvml(init_fails: bool = False) -> types.ModuleType:
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    nv.NVMLError, nv.NVMLError_LibraryNotFound = NVMLError, NVMLError_LibraryNotFound
    nv.NVML_VALUE_NOT_AVAILABLE = 2**64 - 1
    devs = [
        NS(name="NVIDIA H200", util=NS(gpu=87, memory=40), mem=NS(used=40 << 30, total=141 << 30),
           procs=[NS(pid=4242, usedGpuMemory=30 << 30), NS(pid=77, usedGpuMemory=None)]),
        NS(name=b"NVIDIA H200 MIG 1g.18gb", util=None, mem=NS(used=1 << 30, total=18 << 30),
           procs=[NS(pid=5, usedGpuMemory=2**64 - 1)]),
    ]

    def init():
        if init_fails:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def util(h):
        if devs[h].util is None:
            raise NVMLError("Not Supported")
        return devs[h].util

    nv.nvmlInit = init
    nv.nvmlDeviceGetCount = lambda: len(devs)
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetName = lambda h: devs[h].name
    nv.nvmlDeviceGetUtilizationRates = util
    nv.nvmlDeviceGetMemoryInfo = lambda h: devs[h].mem
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: devs[h].procs
    return nv


@pytest.fixture
def nvml(monkeypatch):
    def use(nv):
        monkeypatch.setitem(sys.modules, "pynvml", nv)
        gpus._nvml.cache_clear()
    yield use
    gpus._nvml.cache_clear()


def test_gpus_from_nvml_with_what_it_does_not_give_as_none(nvml):
    nvml(fake_nvml())
    got, note = gpus.read_gpus()
    assert note == ""
    assert got == (Gpu(0, "NVIDIA H200", 87.0, 40 << 30, 141 << 30, ((77, None), (4242, 30 << 30))),
                   Gpu(1, "NVIDIA H200 MIG 1g.18gb", None, 1 << 30, 18 << 30, ((5, None),)))


def test_no_driver_and_no_package_say_why(nvml, monkeypatch):
    nvml(fake_nvml(init_fails=True))
    assert gpus.read_gpus() == ((), "no NVIDIA driver here (libnvidia-ml.so.1 not found)")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    gpus._nvml.cache_clear()
    assert gpus.read_gpus() == ((), "nvidia-ml-py is not installed (pip install nvidia-ml-py)")


def test_frames_carry_each_gpus_processes():
    f = frame(0)
    back = host_from_dict(host_dict(f))
    assert back.gpus == f.gpus and back.gpus[0].processes == ((1111, 2 << 30), (4242, 30 << 30), (9999, None))


def test_the_panel_line_of_a_gpu():
    g = frame(0).gpus[0]
    line = gpu_line(g, {4242, 1111, 2222}).plain
    assert "GPU0" in line and "87%" in line and "40.0 GiB / 141.0 GiB" in line and "3 processes (2 traced)" in line
    unknown = gpu_line(Gpu(1, "x", None, None, None), set()).plain
    assert " - " in unknown and "0%" not in unknown and "0 processes" in unknown  # not known is never shown as 0
    assert bar(0.5, 4) == "██░░" and bar(None, 3) == "   " and bar(1.7, 2) == "██" and bar(0.0625, 2) == "▏░"


def test_the_detail_screen_names_the_gpus_a_process_is_on():
    from gputrace.tui.screens.detail import gpus_of

    g = frame(0).gpus
    assert gpus_of(4242, g) == "GPU0 (30.0 GiB)" and gpus_of(9999, g) == "GPU0 (-)"
    assert gpus_of(3333, g) == "none listed by NVML" and gpus_of(3333, ()) == "not known (no NVML)"
